"""Sharding plans as plain data: ``ShardingPlan``, its YAML form, user overrides and their merge.

A plan maps module FQNs (in model order) to their :class:`ModuleShardingSpec` plus the
mesh it was made for. It round-trips through YAML (``dump_plan`` / ``load_plan``) and
has a fingerprint that every rank compares before apply. Overrides are lists of
``OverrideEntry`` (from Python or YAML) that :func:`resolve_overrides` merges into the
derived boundaries with the "unset inherits, set wins" rule (SPEC 2.3).

Security note: a plan or override file names injected code by registry name or by a
``{_target_: pkg.module.function}`` dotted path. Dotted paths are imported only when the
plan is applied, and only from installed hp plugins or packages the user trusted
(``hp_core.trust_packages`` / ``HP_TRUSTED_PACKAGES``). A plan dumped from Python with a
decorated function in it therefore needs that function's package trusted to be loaded
back and applied.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
import re
import warnings
from collections.abc import ItemsView, Iterable, Iterator, Mapping, Sequence
from typing import Any, Union

import yaml
from torch.distributed.tensor import Placement

from hp_core.bounded.limits import InputLimitError, read_bounded
from hp_core.bounded.yaml_reader import load_yaml
from hp_core.errors import HpError
from hp_core.injection import Target, TargetError
from hp_core.spec import (
    AUTO,
    CANONICAL_AXES,
    NONE,
    IncompleteContractError,
    ModuleShardingSpec,
    PlacementSyntaxError,
    SpecValidationError,
    UnsupportedPartialError,
    check_lowerable,
    close_matches,
    finalize_insert,
    format_placement,
    keyword_checked,
    merge_specs,
    parse_named_placement,
    parse_placement,
)

__all__ = [
    "OVERRIDE_FIELDS",
    "PLAN_FORMAT_VERSION",
    "USER_FIELDS",
    "WHEN_VALUES",
    "ArgumentTypeError",
    "DuplicateOverrideError",
    "IncompleteOverrideError",
    "OverrideEntry",
    "OverrideError",
    "OverrideMatchWarning",
    "OverridesLike",
    "OverridesTypeError",
    "PlanError",
    "PlanTypeError",
    "PlanYAMLError",
    "PlanYAMLInputLimitError",
    "ShardingPlan",
    "compile_glob",
    "copy_spec",
    "dump_overrides",
    "dump_plan",
    "is_glob",
    "load_overrides",
    "load_plan",
    "overrides_to_list",
    "plan_from_dict",
    "plan_to_dict",
    "resolve_overrides",
]

#: Version of the YAML/dict plan document written by :func:`dump_plan`.
PLAN_FORMAT_VERSION = 1
#: Values of an override entry's ``when:`` (``sp`` = sequence parallel is on).
WHEN_VALUES = ("tp", "cp", "ep", "sp")


# ------------------------------------------------------------------------ errors


class PlanError(HpError, ValueError):
    """A malformed plan, plan document or override (base class)."""


class PlanYAMLError(PlanError):
    """A plan document (YAML text, file or dict) that cannot be read or written."""


class PlanYAMLInputLimitError(PlanYAMLError, InputLimitError):
    """A plan or overrides document over hp's input limits (size, nesting depth, YAML alias
    expansion; see :mod:`hp_core.bounded`): both a :class:`PlanYAMLError` and an
    :class:`~hp_core.bounded.InputLimitError`."""


class OverrideError(PlanError):
    """An override entry that is malformed or does not fit the model and mesh."""


class IncompleteOverrideError(OverrideError, IncompleteContractError):
    """An override that inserts a new boundary without declaring its full contract."""


class DuplicateOverrideError(OverrideError):
    """Two exact override entries for the same module (and the same ``when``)."""


class ArgumentTypeError(HpError, TypeError):
    """A public function got an argument of the wrong type (``plan(None, ...)``)."""


class PlanTypeError(ArgumentTypeError, PlanYAMLError):
    """``load_plan`` / ``dump_plan`` got something that is not a plan source / a ShardingPlan."""


class OverridesTypeError(ArgumentTypeError, OverrideError):
    """``overrides`` of a type that holds no overrides (neither YAML, a path, a dict nor a list)."""


class OverrideMatchWarning(UserWarning):
    """A glob override matched no derived boundary (it has no effect)."""


# ----------------------------------------------------------------- field tables

_PLACEMENT_MAP_FIELDS = ("params", "in_src", "in_dst")
_OUT_FIELDS = ("out_src", "out_dst")
_NAME_LIST_FIELDS = ("out_names", "tp_divide_attrs")
_OPT_BOOL_FIELDS = ("skip_source_lowering", "region_dispatch")
_INJECTION_FIELDS = ("inner_wrapper", "local_compute_fn")

#: User fields of ModuleShardingSpec, in dataclass order (the key order of a dumped spec).
USER_FIELDS = tuple(f.name for f in dataclasses.fields(ModuleShardingSpec) if f.init)
#: Fields a user override may set (``skip_source_lowering`` belongs to codegen).
OVERRIDE_FIELDS = tuple(n for n in USER_FIELDS if n != "skip_source_lowering")
#: Internal fields written under a module's ``_internal:`` mapping (YAML key → attribute).
_INTERNAL_FIELDS = {
    "tp_local_attr_plan": "_tp_local_attr_plan",
    "deferred_bias_params": "_deferred_bias_params",
    "is_terminal": "_is_terminal",
    "needs_cp_attn": "_needs_cp_attn",
    "ep_stack": "_ep_stack",
    "ep_size": "_ep_size",
}
#: Runtime introspection written by apply(); never serialized, never fingerprinted.
_RUNTIME_FIELDS = ("_resolved_inner_wrapper", "_resolved_inner_target")
#: Fields that hold layouts (``{name: {axis: placement}}``) once a spec is normalized.
_LAYOUT_FIELDS = (*_PLACEMENT_MAP_FIELDS, *_OUT_FIELDS, "inner_out_src")

_EXAMPLE = {
    "params": "{q_proj.weight: {tp: shard(0)}}",
    "in_src": "{hidden_states: {tp: shard(1)}}",
    "in_dst": "{hidden_states: {tp: replicate}}",
    "out_src": "{output: {tp: partial}}",
    "out_dst": "{output: {tp: shard(1)}}",
    "inner_out_src": "{tp: shard(1)}",
}
_ENTRY_EXAMPLE = (
    "  - match: model.layers.*.mlp\n    when: tp\n    out_dst: {output: {tp: replicate}}"
)
_TOP_EXAMPLE = "version: 1\nmesh: {axis_names: [tp], shape: [4]}\nmodules: {...}"


def _tname(value: Any) -> str:
    return type(value).__name__


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _did_you_mean(name: str, candidates: Iterable[str]) -> str:
    best = close_matches(name, candidates, n=1)
    return f" Did you mean {best[0]!r}?" if best else ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------- spec helpers


def _deep(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_deep(v) for v in value)
    if isinstance(value, Target):
        return dataclasses.replace(value, config=_deep(value.config))
    return value  # placements are immutable; callables and scalars are shared


def copy_spec(spec: ModuleShardingSpec) -> ModuleShardingSpec:
    """A copy whose containers (and Targets) are independent of ``spec``'s, internals included.

    Runtime introspection fields (``_resolved_*``) keep their references.
    """
    new = copy.copy(spec)
    for f in dataclasses.fields(spec):
        if f.name not in _RUNTIME_FIELDS:
            setattr(new, f.name, _deep(getattr(spec, f.name)))
    return new


def _callable_path(fn: Any) -> tuple[str, bool]:
    """``module.qualname`` of a callable, and whether that path can be imported back."""
    module = getattr(fn, "__module__", None)
    qual = getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qual, str):
        cls = type(fn)
        return f"{cls.__module__}.{cls.__qualname__}", False
    importable = "." not in qual and "<" not in qual and module != "__main__"
    return f"{module}.{qual}", importable


# ---------------------------------------------------------- spec → plain data


def _layout_to_data(named: Any, path: str, err: type[PlanError]) -> dict[str, str]:
    if not isinstance(named, Mapping):
        raise err(
            f"{path}: expected an {{axis: placement}} mapping, got {_tname(named)} {named!r}."
        )
    out: dict[str, str] = {}
    for axis, p in named.items():
        try:
            out[str(axis)] = format_placement(parse_placement(p, path=f"{path}.{axis}"))
        except PlacementSyntaxError as e:
            msg = str(e)
            raise err(msg if msg.startswith(path) else f"{path}.{axis}: {msg}") from e
    return out


def _injection_to_data(value: Any, path: str, err: type[PlanError], strict: bool) -> Any:
    if isinstance(value, Target):
        return {"_target_": value.target, **_deep(value.config)}
    if callable(value):
        dotted, importable = _callable_path(value)
        if strict and not importable:
            raise err(
                f"{path}: {dotted} cannot be written to a file: only a module-level function of an "
                "importable module can be referenced by a dotted path (not a lambda, a nested "
                "function, a method or a function of __main__). Register it under a name "
                "(hp_core's register_* functions or a plugin hook) and write that name, or "
                "move it to module level."
            )
        return {"_target_": dotted}
    raise err(f"{path}: expected a registry name, a decorated function or a Target, got {value!r}.")


def _spec_field_to_data(
    name: str, value: Any, path: str, err: type[PlanError], strict: bool
) -> Any:
    if isinstance(value, str) or name in ("is_boundary", "inner_target", *_OPT_BOOL_FIELDS):
        return value  # sentinels, 'first_input', booleans, inner target names
    if name in _LAYOUT_FIELDS:
        if not isinstance(value, Mapping):
            raise err(f"{path}: expected a mapping of name to {{axis: placement}}, got {value!r}.")
        return {str(k): _layout_to_data(v, f"{path}.{k}", err) for k, v in value.items()}
    if name in _NAME_LIST_FIELDS:
        return [str(v) for v in value]
    return _injection_to_data(value, path, err, strict)


def _spec_to_data(
    spec: ModuleShardingSpec,
    path: str,
    err: type[PlanError],
    *,
    fields: Sequence[str],
    internals: bool,
    strict: bool,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in fields:
        value = getattr(spec, name)
        if value is None or (name == "is_boundary" and value is True):
            continue
        out[name] = _spec_field_to_data(name, value, f"{path}.{name}", err, strict)
    if internals:
        internal = _internals_to_data(spec)
        if internal:
            out["_internal"] = internal
    return out


def _internals_to_data(spec: ModuleShardingSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if spec._tp_local_attr_plan is not None:
        out["tp_local_attr_plan"] = {
            str(k): [int(x) for x in v] for k, v in spec._tp_local_attr_plan.items()
        }
    if spec._deferred_bias_params:
        out["deferred_bias_params"] = [str(p) for p in spec._deferred_bias_params]
    if spec._is_terminal:
        out["is_terminal"] = True
    if spec._needs_cp_attn:
        out["needs_cp_attn"] = True
    if spec._ep_stack:
        out["ep_stack"] = {str(k): [str(s) for s in v] for k, v in spec._ep_stack.items()}
    if spec._ep_size:
        out["ep_size"] = int(spec._ep_size)
    return out


# ---------------------------------------------------------- plain data → spec


def _check_keys(
    raw: Mapping[Any, Any],
    path: str,
    err: type[PlanError],
    valid: Sequence[str],
    *,
    internal_hint: str | None = None,
    special: Mapping[str, str] | None = None,
) -> None:
    for key in raw:
        if not isinstance(key, str):
            raise err(
                f"{path}: keys must be strings, got {_tname(key)} {key!r}. Valid keys: {', '.join(valid)}."
            )
        if key in valid:
            continue
        if special and key in special:
            raise err(f"{path}.{key}: {special[key]}")
        if internal_hint and key.startswith("_"):
            raise err(f"{path}.{key}: {internal_hint}")
        raise err(
            f"{path}: unknown key {key!r}.{_did_you_mean(key, valid)} Valid keys: {', '.join(valid)}."
        )


def _parse_layout(
    raw: Any, path: str, err: type[PlanError], module: str | None = None
) -> dict[str, Placement]:
    """``{axis: Placement}`` from DSL strings or Placements. ``module`` (an override's
    ``match``) is named in the refusal of a partial hp cannot lower."""
    try:
        named = parse_named_placement(raw, path=path)
    except UnsupportedPartialError as e:
        # parse_placement refused a 'partial(op)' string at f"{path}.{axis}": name the module
        # right after that path (the axis comes from ``raw``, not from splitting the message).
        message = str(e)
        if module is not None and isinstance(raw, Mapping):
            for axis in raw:
                where = f"{path}.{str(axis).strip()}"
                if message.startswith(f"{where}: "):
                    message = f"{where} (module {module!r}){message[len(where) :]}"
                    break
        raise err(message) from e
    except PlacementSyntaxError as e:
        raise err(str(e)) from e
    if module is not None:  # Placement objects (Partial('max')) from Python: check them here, naming the module
        for axis, p in named.items():
            try:
                check_lowerable(p, path=f"{path}.{axis}", module=module)
            except UnsupportedPartialError as e:
                raise err(str(e)) from e
    return named


def _parse_layout_map(
    raw: Any, name: str, path: str, err: type[PlanError], *, sentinels: bool, module: str | None = None
) -> Any:
    out_like = name in (*_OUT_FIELDS, "inner_out_src")
    if isinstance(raw, str):
        if sentinels and raw in (AUTO, NONE):
            return raw
        allowed = (
            "'auto' (inherit the derived value) and 'none' (clear it)"
            if sentinels
            else "'first_input'"
        )
        raise err(
            f"{path}: {raw!r} is not allowed here; the only string values are {allowed}. "
            f"Otherwise write a mapping, e.g. {name}: {_EXAMPLE[name]}."
        )
    if not isinstance(raw, Mapping):
        raise err(
            f"{path}: expected a mapping of name to {{axis: placement}}, got {_tname(raw)} {raw!r}. "
            f"Example: {name}: {_EXAMPLE[name]}."
        )
    if out_like and raw and all(isinstance(v, (str, Placement)) for v in raw.values()):
        return {"output": _parse_layout(raw, path, err, module)}  # scalar shorthand {tp: ...}
    out: dict[str, dict[str, Placement]] = {}
    for key, named in raw.items():
        if not isinstance(key, str) or not key:
            raise err(
                f"{path}: keys must be non-empty strings (parameter paths or input/output names), "
                f"got {key!r}. Example: {name}: {_EXAMPLE[name]}."
            )
        out[key] = _parse_layout(named, f"{path}.{key}", err, module)
    return out


def _parse_names(raw: Any, path: str, err: type[PlanError]) -> Any:
    if isinstance(raw, str):
        if raw in (AUTO, NONE):
            return raw
        raise err(
            f"{path}: expected a list of names, or 'auto' / 'none', got the string {raw!r}. "
            f"Write a list, e.g. [{raw}]."
        )
    if not isinstance(raw, (list, tuple)):
        raise err(f"{path}: expected a list of names, got {_tname(raw)} {raw!r}.")
    for i, item in enumerate(raw):
        if not isinstance(item, str) or not item:
            raise err(f"{path}[{i}]: expected a non-empty string, got {item!r}.")
    return list(raw)


def _parse_bool(raw: Any, path: str, err: type[PlanError], *, optional: bool) -> bool | None:
    if isinstance(raw, bool) or (optional and raw is None):
        return raw
    allowed = "true, false or null" if optional else "true or false"
    raise err(f"{path}: expected {allowed}, got {_tname(raw)} {raw!r}.")


def _parse_injection(raw: Any, path: str, err: type[PlanError]) -> Any:
    if isinstance(raw, str):
        if not raw.strip():
            raise err(
                f"{path}: an empty string names no registry item. Write a registry name or {{_target_: ...}}."
            )
        return raw
    if isinstance(raw, Target):
        return raw
    if isinstance(raw, Mapping):
        if "_target_" not in raw:
            typo = next(
                (k for k in raw if isinstance(k, str) and close_matches(k, ["_target_"], n=1)), None
            )
            hint = f" {typo!r} looks like a misspelling of '_target_'." if typo else ""
            raise err(
                f"{path}: a mapping here must name what it refers to with _target_.{hint} "
                f"Write {{_target_: NAME_OR_DOTTED_PATH, config_key: value, ...}}, got {dict(raw)!r}."
            )
        try:
            return Target.from_dict(raw, path=path)
        except TargetError as e:
            raise err(str(e)) from e
    if callable(raw):
        return raw
    raise err(
        f"{path}: expected a registry name (string), {{_target_: ...}} or a decorated function, "
        f"got {_tname(raw)} {raw!r}."
    )


def _parse_field(name: str, raw: Any, path: str, err: type[PlanError], *, module: str | None = None) -> Any:
    if name == "is_boundary":
        return _parse_bool(raw, path, err, optional=False)
    if raw is None:
        return None
    if name in (*_PLACEMENT_MAP_FIELDS, *_OUT_FIELDS):
        return _parse_layout_map(raw, name, path, err, sentinels=True, module=module)
    if name in _NAME_LIST_FIELDS:
        return _parse_names(raw, path, err)
    if name in _OPT_BOOL_FIELDS:
        return _parse_bool(raw, path, err, optional=True)
    if name == "inner_target":
        if isinstance(raw, str) and raw.strip():
            return raw
        raise err(f"{path}: expected 'self' or the attribute name of a child module, got {raw!r}.")
    if name == "inner_out_src":
        if raw == "first_input":
            return raw
        return _parse_layout_map(raw, name, path, err, sentinels=False, module=module)
    return _parse_injection(raw, path, err)


def _relabel(message: str, path: str) -> str:
    prefix = "ModuleShardingSpec."
    if message.startswith(prefix):
        return f"{path}.{message[len(prefix) :]}"
    return f"{path}: {message}"


def _build_spec(
    raw: Mapping[str, Any],
    path: str,
    err: type[PlanError],
    fields: Sequence[str],
    *,
    module: str | None = None,
) -> ModuleShardingSpec:
    """The spec ``raw`` describes; ``module`` (an override's ``match``) is named when a
    placement is a partial hp cannot lower."""
    parse = _parse_field if module is None else functools.partial(_parse_field, module=module)
    kwargs = {name: parse(name, raw[name], f"{path}.{name}", err) for name in fields if name in raw}
    try:
        return ModuleShardingSpec(**kwargs)
    except (SpecValidationError, PlacementSyntaxError, TargetError) as e:
        raise err(_relabel(str(e), path)) from e


def _apply_internals(spec: ModuleShardingSpec, raw: Any, path: str) -> None:
    err = PlanYAMLError
    if not isinstance(raw, Mapping):
        raise err(f"{path}: expected a mapping of internal fields, got {_tname(raw)} {raw!r}.")
    valid = tuple(_INTERNAL_FIELDS)
    runtime = {
        key: "runtime introspection written by apply(); it is not part of a plan file. Remove it."
        for n in _RUNTIME_FIELDS
        for key in (n, n.lstrip("_"))
    }
    _check_keys(
        raw,
        path,
        err,
        valid,
        internal_hint="write internal keys without the leading underscore.",
        special=runtime,
    )
    for key, value in raw.items():
        where = f"{path}.{key}"
        if key == "tp_local_attr_plan":
            parsed: Any = None
            if value is not None:
                if not isinstance(value, Mapping):
                    raise err(
                        f"{where}: expected a mapping of attribute name to [global, local], got {value!r}."
                    )
                parsed = {}
                for attr, pair in value.items():
                    if not isinstance(attr, str) or not (
                        isinstance(pair, (list, tuple))
                        and len(pair) == 2
                        and all(_is_int(x) for x in pair)
                    ):
                        raise err(
                            f"{where}.{attr}: expected a pair of integers [global, local], got {pair!r}."
                        )
                    parsed[attr] = (pair[0], pair[1])
        elif key == "deferred_bias_params":
            if isinstance(value, str):
                raise err(f"{where}: expected a list of parameter paths, got {value!r}.")
            parsed = tuple(_parse_names(value, where, err)) if value is not None else ()
        elif key in ("is_terminal", "needs_cp_attn"):
            parsed = _parse_bool(value, where, err, optional=False)
        elif key == "ep_stack":
            if not isinstance(value, Mapping):
                raise err(
                    f"{where}: expected a mapping of stacked path to [source paths], got {value!r}."
                )
            parsed = {}
            for stacked, sources in value.items():
                if not isinstance(stacked, str) or isinstance(sources, str):
                    raise err(
                        f"{where}.{stacked}: expected a list of source parameter paths, got {sources!r}."
                    )
                parsed[stacked] = _parse_names(sources, f"{where}.{stacked}", err)
        else:  # ep_size
            if not _is_int(value) or value < 0:
                raise err(f"{where}: expected a non-negative integer, got {value!r}.")
            parsed = value
        setattr(spec, _INTERNAL_FIELDS[key], parsed)


# ------------------------------------------------------------------ the plan


def _check_axis_names(raw: Any, path: str, err: type[PlanError]) -> tuple[str, ...]:
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Iterable):
        raise err(f"{path}: expected a list of mesh axis names such as [tp, cp], got {raw!r}.")
    names = tuple(raw)
    for i, n in enumerate(names):
        if not isinstance(n, str) or not n.strip():
            raise err(f"{path}[{i}]: expected a non-empty axis name, got {n!r}.")
    out = tuple(str(n) for n in names)  # MeshAxisName → plain str
    dupes = sorted({n for n in out if out.count(n) > 1})
    if dupes:
        raise err(
            f"{path}: axis names must be unique, {dupes} appear more than once in {list(out)}."
        )
    return out


def _check_shape(
    raw: Any, names: tuple[str, ...], path: str, err: type[PlanError]
) -> tuple[int, ...] | None:
    if raw is None:
        return None
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Iterable):
        raise err(f"{path}: expected a list of positive axis sizes such as [4, 2], got {raw!r}.")
    shape = tuple(raw)
    for i, n in enumerate(shape):
        if not _is_int(n) or n < 1:
            raise err(f"{path}[{i}]: expected a positive integer axis size, got {n!r}.")
    if len(shape) != len(names):
        raise err(
            f"{path}: {len(shape)} size(s) {list(shape)} for {len(names)} axis name(s) {list(names)}; "
            "give one size per axis, in the same order."
        )
    return tuple(int(n) for n in shape)


@keyword_checked
@dataclasses.dataclass
class ShardingPlan:
    """The contracts of every boundary of one model for one mesh (plain data).

    ``modules`` maps module FQNs, in model order, to their spec; ``mesh_shape`` is None
    when only the axis names are known. ``notes`` records what merging overrides dropped;
    it takes part in neither equality nor the fingerprint. (The planner's ``plan()`` passes
    its own defaults, e.g. ``sequence_parallel=True``.)
    """

    modules: dict[str, ModuleShardingSpec]
    mesh_axis_names: tuple[str, ...]
    mesh_shape: tuple[int, ...] | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False
    ep_size: int = 1
    notes: list[str] = dataclasses.field(default_factory=list, compare=False)

    def __post_init__(self) -> None:
        cls = "ShardingPlan"
        if not isinstance(self.modules, Mapping):
            raise PlanError(
                f"{cls}.modules: expected a dict of module FQN to ModuleShardingSpec, got {self.modules!r}."
            )
        modules: dict[str, ModuleShardingSpec] = {}
        for fqn, spec in self.modules.items():
            if not isinstance(fqn, str):
                raise PlanError(f"{cls}.modules: keys must be module FQN strings, got {fqn!r}.")
            if not isinstance(spec, ModuleShardingSpec):
                raise PlanError(
                    f"{cls}.modules[{fqn!r}]: expected a ModuleShardingSpec, got {_tname(spec)} {spec!r}."
                )
            modules[fqn] = spec
        self.modules = modules
        self.mesh_axis_names = _check_axis_names(
            self.mesh_axis_names, f"{cls}.mesh_axis_names", PlanError
        )
        self.mesh_shape = _check_shape(
            self.mesh_shape, self.mesh_axis_names, f"{cls}.mesh_shape", PlanError
        )
        for name in ("sequence_parallel", "loss_parallel"):
            _parse_bool(getattr(self, name), f"{cls}.{name}", PlanError, optional=False)
        if not _is_int(self.ep_size) or self.ep_size < 1:
            raise PlanError(f"{cls}.ep_size: expected a positive integer, got {self.ep_size!r}.")
        if not isinstance(self.notes, (list, tuple)) or not all(
            isinstance(n, str) for n in self.notes
        ):
            raise PlanError(f"{cls}.notes: expected a list of strings, got {self.notes!r}.")
        self.notes = list(self.notes)

    # Mapping-like access by module FQN ------------------------------------
    def __getitem__(self, fqn: str) -> ModuleShardingSpec:
        try:
            return self.modules[fqn]
        except KeyError:
            raise KeyError(
                f"{fqn!r} is not in the plan.{_did_you_mean(fqn, self.modules)}"
            ) from None

    def __contains__(self, fqn: object) -> bool:
        return fqn in self.modules

    def __iter__(self) -> Iterator[str]:
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)

    def items(self) -> ItemsView[str, ModuleShardingSpec]:
        """``(fqn, spec)`` pairs in model order."""
        return self.modules.items()

    def boundaries(self) -> dict[str, ModuleShardingSpec]:
        """The specs that wrap forward (``is_boundary``), in model order."""
        return {fqn: spec for fqn, spec in self.modules.items() if spec.is_boundary}

    def fingerprint(self) -> str:
        """SHA-256 hex of everything that affects execution; ranks compare it before apply.

        Order-sensitive (module and parameter order drive the order of collectives at
        apply time). Injected callables count by ``module.qualname``; notes and the
        runtime ``_resolved_*`` fields do not count.
        """
        data = _plan_data(self, strict=False)
        text = json.dumps(
            data, sort_keys=False, separators=(",", ":"), ensure_ascii=True, default=repr
        )
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def explain(self, report: Any = None) -> str:
        """Plain text: per boundary its params, entry/exit collectives, injections and
        attribute changes, then the predicted collectives per training step (exact for the
        gradient reductions when given the verifier's ``report``)."""
        from hp_core.planner.explain import explain  # local: the planner imports this module

        return explain(self, report)

    def copy(self) -> ShardingPlan:
        """A copy whose specs can be mutated without touching this plan."""
        return ShardingPlan(
            modules={fqn: copy_spec(spec) for fqn, spec in self.modules.items()},
            mesh_axis_names=self.mesh_axis_names,
            mesh_shape=self.mesh_shape,
            sequence_parallel=self.sequence_parallel,
            loss_parallel=self.loss_parallel,
            ep_size=self.ep_size,
            notes=list(self.notes),
        )


# -------------------------------------------------------------- plan ↔ dict


def _plan_data(plan: ShardingPlan, *, strict: bool) -> dict[str, Any]:
    mesh: dict[str, Any] = {"axis_names": list(plan.mesh_axis_names)}
    if plan.mesh_shape is not None:
        mesh["shape"] = list(plan.mesh_shape)
    modules = {
        fqn: _spec_to_data(
            spec,
            f"modules[{fqn!r}]",
            PlanYAMLError,
            fields=USER_FIELDS,
            internals=True,
            strict=strict,
        )
        for fqn, spec in plan.modules.items()
    }
    return {
        "version": PLAN_FORMAT_VERSION,
        "mesh": mesh,
        "sequence_parallel": plan.sequence_parallel,
        "loss_parallel": plan.loss_parallel,
        "ep_size": plan.ep_size,
        "modules": modules,
    }


def plan_to_dict(plan: ShardingPlan) -> dict[str, Any]:
    """The plan as plain data (the document :func:`dump_plan` writes as YAML).

    Placements become DSL strings, internals go under ``_internal``, injected callables
    become ``{_target_: module.qualname}`` (loading those back needs the package trusted).
    """
    if not isinstance(plan, ShardingPlan):
        raise PlanTypeError(
            f"plan_to_dict: expected a ShardingPlan, got {_tname(plan)}. Pass the plan that "
            "hp_core.plan(...) or load_plan returned."
        )
    return _plan_data(plan, strict=True)


_PLAN_KEYS = ("version", "mesh", "sequence_parallel", "loss_parallel", "ep_size", "modules")
_MESH_KEYS = ("axis_names", "shape")
_MODULE_KEYS = (*USER_FIELDS, "_internal")


def plan_from_dict(data: Any) -> ShardingPlan:
    """Build a plan from the document form (inverse of :func:`plan_to_dict`), validating every value."""
    err = PlanYAMLError
    if not isinstance(data, Mapping):
        raise err(
            f"plan: expected a mapping with keys {', '.join(_PLAN_KEYS)}, got {_tname(data)}. Example:\n{_TOP_EXAMPLE}"
        )
    _check_keys(data, "plan", err, _PLAN_KEYS)
    for key in ("version", "mesh", "modules"):
        if key not in data:
            raise err(
                f"{key}: missing required top-level key. A plan document looks like:\n{_TOP_EXAMPLE}"
            )
    if data["version"] != PLAN_FORMAT_VERSION or not _is_int(data["version"]):
        raise err(
            f"version: unsupported plan format version {data['version']!r}; this hp reads version "
            f"{PLAN_FORMAT_VERSION}. Re-create the plan with this hp (hp plan ... / dump_plan)."
        )
    mesh = data["mesh"]
    if not isinstance(mesh, Mapping):
        raise err(
            f"mesh: expected {{axis_names: [...], shape: [...]}}, got {_tname(mesh)} {mesh!r}."
        )
    _check_keys(mesh, "mesh", err, _MESH_KEYS)
    if "axis_names" not in mesh:
        raise err(
            "mesh.axis_names: missing; list the mesh axes in mesh order, e.g. axis_names: [tp, cp]."
        )
    names = _check_axis_names(mesh["axis_names"], "mesh.axis_names", err)
    shape = _check_shape(mesh.get("shape"), names, "mesh.shape", err)
    flags = {
        k: _parse_bool(data.get(k, False), k, err, optional=False)
        for k in ("sequence_parallel", "loss_parallel")
    }
    ep_size = data.get("ep_size", 1)
    if not _is_int(ep_size) or ep_size < 1:
        raise err(f"ep_size: expected a positive integer, got {ep_size!r}.")
    raw_modules = data["modules"]
    if not isinstance(raw_modules, Mapping):
        raise err(
            f"modules: expected a mapping of module FQN to its spec, got {_tname(raw_modules)} {raw_modules!r}."
        )
    modules: dict[str, ModuleShardingSpec] = {}
    for fqn, raw in raw_modules.items():
        if not isinstance(fqn, str):
            raise err(f"modules: keys must be module FQN strings, got {_tname(fqn)} {fqn!r}.")
        path = f"modules[{fqn!r}]"
        if not isinstance(raw, Mapping):
            raise err(
                f"{path}: expected a mapping of spec fields (or {{}}), got {_tname(raw)} {raw!r}."
            )
        _check_keys(
            raw,
            path,
            err,
            _MODULE_KEYS,
            internal_hint="internal fields go under the module's '_internal:' mapping, without the underscore.",
        )
        spec = _build_spec(raw, path, err, USER_FIELDS)
        if "_internal" in raw:
            _apply_internals(spec, raw["_internal"], f"{path}._internal")
        modules[fqn] = spec
    return ShardingPlan(
        modules=modules,
        mesh_axis_names=names,
        mesh_shape=shape,
        sequence_parallel=bool(flags["sequence_parallel"]),
        loss_parallel=bool(flags["loss_parallel"]),
        ep_size=ep_size,
    )


# --------------------------------------------------------------------- YAML I/O

_YAML_SUFFIXES = (".yaml", ".yml", ".json")


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys (YAML would silently keep the last)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:
            continue  # unhashable: construct_mapping reports it
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first at line {first.start_mark.line + 1}); YAML would "
                "silently keep only the last one, so hp refuses the document. Remove or merge one of them",
                key_node.start_mark,
            )
        seen[key] = key_node
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_source(src: Any, what: str) -> tuple[str, str, bool]:
    """``(text, name, is_file)`` from YAML text or a file path."""
    if isinstance(src, os.PathLike):
        path = os.fspath(src)
    elif isinstance(src, str):
        if "\n" in src or not (src.strip().endswith(_YAML_SUFFIXES) or os.path.isfile(src)):
            return src, "<string>", False
        path = src
    else:
        raise PlanYAMLError(
            f"{what}: expected YAML text or a file path, got {_tname(src)} {src!r}."
        )
    try:
        # Bounded: a file over the size cap is refused after reading at most the cap.
        data = read_bounded(path, source=str(path), error=PlanYAMLInputLimitError)
        return data.decode("utf-8"), str(path), True
    except FileNotFoundError:
        raise PlanYAMLError(f"{path}: no such file (reading {what}).") from None
    except UnicodeDecodeError as e:
        raise PlanYAMLError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}).") from None
    except OSError as e:
        raise PlanYAMLError(f"{path}: cannot read {what}: {e.strerror or e}.") from None


def _yaml_load(text: str, name: str) -> Any:
    # A SafeLoader (plain data only) under hp's input limits: size, depth and alias expansion
    # are refused with a PlanYAMLInputLimitError (an InputLimitError that is also a PlanYAMLError).
    try:
        return load_yaml(text, source=name, loader=_StrictLoader, error=PlanYAMLInputLimitError)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else name
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        detail = f"{problem} ({context})" if context else problem
        raise PlanYAMLError(
            f"{where}: invalid YAML: {detail}. Fix the document at that line "
            "(indentation, a missing ':' or an unclosed bracket or quote are the usual causes)."
        ) from None


def _yaml_dump(data: Any, err: type[PlanError]) -> str:
    try:
        return yaml.safe_dump(
            data, sort_keys=False, default_flow_style=None, allow_unicode=True, width=4096
        )
    except yaml.YAMLError as e:
        raise err(
            f"cannot be written as YAML (Target config values must be plain data): {e}"
        ) from e


def _in_file(e: PlanError, name: str) -> PlanError:
    return type(e)(f"{e} (in {name})")


def dump_plan(plan: ShardingPlan) -> str:
    """The plan as YAML text; ``load_plan(dump_plan(p)) == p`` and dumping is byte-stable.

    A decorated function in the plan is written as ``{_target_: module.qualname}``; applying
    the loaded plan imports it only if its package is an hp plugin or trusted by the user.
    """
    if not isinstance(plan, ShardingPlan):
        raise PlanTypeError(
            f"dump_plan: expected a ShardingPlan, got {_tname(plan)} {_short(plan)}. Pass the plan "
            "that hp_core.plan(...) or load_plan returned."
        )
    return _yaml_dump(_plan_data(plan, strict=True), PlanYAMLError)


def load_plan(text_or_path: str | os.PathLike[str]) -> ShardingPlan:
    """Read a plan from YAML text or a ``.yaml``/``.yml``/``.json`` file written by :func:`dump_plan`."""
    if not isinstance(text_or_path, (str, os.PathLike)):
        hint = " (it is one already: use it as is, or plan.copy())" if isinstance(text_or_path, ShardingPlan) else ""
        raise PlanTypeError(
            f"a plan: expected YAML text or a file path, got {_tname(text_or_path)} {_short(text_or_path)} "
            f"(load_plan takes a str or an os.PathLike){hint}. For a dict, use hp_core.sharding_plan.plan_from_dict."
        )
    text, name, is_file = _read_source(text_or_path, "a plan")
    data = _yaml_load(text, name)
    try:
        return plan_from_dict(data)
    except PlanError as e:
        if is_file:
            raise _in_file(e, name) from e
        raise


# -------------------------------------------------------------------- overrides


def _check_when(value: Any, path: str, err: type[PlanError] = OverrideError) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and str(value) in WHEN_VALUES:
        return str(value)
    hint = _did_you_mean(value.lower(), WHEN_VALUES) if isinstance(value, str) else ""
    raise err(
        f"{path}: {value!r} is not a valid 'when'.{hint} Valid values: {', '.join(WHEN_VALUES)} "
        "(the entry applies only while that axis is active; sp = sequence parallel is on). "
        "Leave 'when' out to apply the entry always."
    )


@keyword_checked
@dataclasses.dataclass(frozen=True)
class OverrideEntry:
    """One user override: a module FQN or glob, the spec to merge, an optional axis condition.

    ``source`` (e.g. ``overrides[2]``) names the entry in error messages; it does not
    take part in equality. An empty ``match`` names the root module.
    """

    match: str
    spec: ModuleShardingSpec
    when: str | None = None
    source: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        where = self.source or "OverrideEntry"
        if not isinstance(self.source, str):
            raise OverrideError(f"OverrideEntry.source: expected a string, got {self.source!r}.")
        if not isinstance(self.match, str):
            raise OverrideError(
                f"{where}.match: expected a module FQN or glob string, got {_tname(self.match)} {self.match!r}."
            )
        if not isinstance(self.spec, ModuleShardingSpec):
            raise OverrideError(
                f"{where}: expected a ModuleShardingSpec, got {_tname(self.spec)} {self.spec!r}. "
                "Write ModuleShardingSpec(...) in Python, or an entry with match: and spec fields in YAML."
            )
        if self.spec.skip_source_lowering is not None:
            raise OverrideError(f"{where}.skip_source_lowering: {_SKIP_LOWERING_MSG}")
        object.__setattr__(self, "when", _check_when(self.when, f"{where}.when"))


_SKIP_LOWERING_MSG = "set by codegen (hp freeze) only, not by overrides. Remove it."
_OVERRIDE_INTERNAL_MSG = (
    "internal fields (leading underscore) are set by the planner and applier, never by "
    f"overrides. Remove it; an override may set: {', '.join(OVERRIDE_FIELDS)}."
)
_ENTRY_KEYS = ("match", "when", *OVERRIDE_FIELDS)

#: What :func:`load_overrides` (and so ``plan(overrides=...)``) accepts.
OverridesLike = Union[
    None,
    str,
    os.PathLike[str],
    Mapping[str, ModuleShardingSpec],
    Iterable[Union[OverrideEntry, Mapping[str, Any]]],
]


def _entry_from_mapping(raw: Any, path: str) -> OverrideEntry:
    err = OverrideError
    if not isinstance(raw, Mapping):
        raise err(
            f"{path}: expected a mapping with a 'match' key, got {_tname(raw)} {raw!r}. An entry looks like:\n{_ENTRY_EXAMPLE}"
        )
    _check_keys(
        raw,
        path,
        err,
        _ENTRY_KEYS,
        internal_hint=_OVERRIDE_INTERNAL_MSG,
        special={"skip_source_lowering": _SKIP_LOWERING_MSG},
    )
    match = raw.get("match")
    if match is None:
        raise err(
            f"{path}: missing required key 'match' (the FQN or glob of the module(s) this entry "
            f"overrides). Add it, e.g.\n{_ENTRY_EXAMPLE}"
        )
    if not isinstance(match, str):
        raise err(
            f"{path}.match: expected a module FQN or glob string, got {_tname(match)} {match!r}."
        )
    when = _check_when(raw.get("when"), f"{path}.when")
    spec = _build_spec(raw, path, err, OVERRIDE_FIELDS, module=match)
    return OverrideEntry(match, spec, when, source=path)


def _entries_from_document(doc: Any, name: str) -> list[OverrideEntry]:
    err = OverrideError
    if doc is None:
        return []
    if isinstance(doc, Mapping):
        if "match" in doc:
            raise err(
                "overrides: the document is a single entry; write entries as a list (prefix the "
                f"entry with '- '), e.g.\n{_ENTRY_EXAMPLE}"
            )
        _check_keys(doc, "overrides", err, ("overrides",))
        items = doc.get("overrides")
        if items is None:
            return []
    else:
        items = doc
    if not isinstance(items, list):
        hint = ""
        if isinstance(items, str) and name == "<string>" and "\n" not in items.strip():
            hint = " (If this was meant as a file path: no such file exists.)"
        raise err(
            f"overrides: expected a list of entries or {{overrides: [...]}}, got {_tname(items)} {items!r}."
            f"{hint} An entry looks like:\n{_ENTRY_EXAMPLE}"
        )
    entries = [_entry_from_mapping(item, f"overrides[{i}]") for i, item in enumerate(items)]
    _check_duplicates(entries)
    return entries


def load_overrides(text_or_path_or_list: OverridesLike) -> list[OverrideEntry]:
    """Normalize overrides from YAML (text or file), ``{fqn: spec}``, or a list of entries/dicts.

    A YAML document is a list of entries or ``{overrides: [...]}``; each entry has
    ``match`` (FQN or glob), optional ``when`` and spec fields. Every problem raises
    :class:`OverrideError` (or :class:`PlanYAMLError` for unreadable YAML) naming its path.

    Two exact entries (no glob) for the same module with the same ``when`` raise
    :class:`DuplicateOverrideError`: merge them into one entry. Entries with different
    ``when`` conditions may name the same module; those that apply merge in list order.
    """
    src = text_or_path_or_list
    if src is None:
        return []
    if isinstance(src, (str, os.PathLike)):
        text, name, is_file = _read_source(src, "overrides")
        doc = _yaml_load(text, name)
        try:
            return _entries_from_document(doc, name)
        except PlanError as e:
            if is_file:
                raise _in_file(e, name) from e
            raise
    if isinstance(src, Mapping):
        if set(src) == {"overrides"} and not isinstance(src["overrides"], ModuleShardingSpec):
            return _entries_from_document(src, "<dict>")
        entries = []
        for key, spec in src.items():
            path = f"overrides[{key!r}]"
            if not isinstance(key, str):
                raise OverrideError(
                    f"overrides: keys must be module FQN or glob strings, got {_tname(key)} {key!r}."
                )
            if not isinstance(spec, ModuleShardingSpec):
                raise OverrideError(
                    f"{path}: expected a ModuleShardingSpec, got {_tname(spec)} {spec!r}. In Python write "
                    f"{{{key!r}: ModuleShardingSpec(...)}}; for dict entries use a list: "
                    f"[{{'match': {key!r}, ...}}]."
                )
            entries.append(OverrideEntry(key, spec, None, source=path))
        return entries
    if not isinstance(src, Iterable):
        hint = (
            " Key a spec by the module it overrides: {'model.layers.0.mlp': ModuleShardingSpec(...)}."
            if isinstance(src, ModuleShardingSpec)
            else ""
        )
        raise OverridesTypeError(
            f"overrides: expected YAML text, a file path, {{fqn: ModuleShardingSpec}} or a list of "
            f"entries, got {_tname(src)} {_short(src)}.{hint}"
        )
    out: list[OverrideEntry] = []
    for i, item in enumerate(src):
        path = f"overrides[{i}]"
        if isinstance(item, OverrideEntry):
            out.append(item if item.source else dataclasses.replace(item, source=path))
        else:
            out.append(_entry_from_mapping(item, path))
    _check_duplicates(out)
    return out


def _entry_text(entry: OverrideEntry) -> str:
    """One line of an entry's content, for messages (YAML flow style where it can be written)."""
    item: dict[str, Any] = {"match": entry.match}
    if entry.when is not None:
        item["when"] = entry.when
    try:
        item.update(
            _spec_to_data(
                entry.spec, entry.source or "overrides", OverrideError, fields=OVERRIDE_FIELDS, internals=False, strict=False
            )
        )
        return yaml.safe_dump(item, default_flow_style=True, sort_keys=False, width=1 << 16, allow_unicode=True).strip()
    except (PlanError, yaml.YAMLError):
        return f"{item!r} {entry.spec!r}"


def _check_duplicates(entries: Sequence[OverrideEntry]) -> None:
    seen: dict[tuple[str, str | None], tuple[int, OverrideEntry]] = {}
    for i, entry in enumerate(entries):
        if is_glob(entry.match):
            continue
        key = (entry.match, entry.when)
        if key not in seen:
            seen[key] = (i, entry)
            continue
        j, first = seen[key]
        a, b = first.source or f"overrides[{j}]", entry.source or f"overrides[{i}]"
        cond = f"when: {entry.when}" if entry.when is not None else "no 'when'"
        raise DuplicateOverrideError(
            f"{a} and {b} are both exact overrides for module {entry.match!r} ({cond}); the second would "
            "silently replace every field the first also sets.\n"
            f"  {a} (entry {j}): {_entry_text(first)}\n"
            f"  {b} (entry {i}): {_entry_text(entry)}\n"
            f"Fix: merge them into one entry for {entry.match!r} (for a field both set, keep the value you "
            "want). Entries with different 'when:' conditions may name the same module; those that apply "
            "merge in list order."
        )


def overrides_to_list(entries: OverridesLike) -> list[dict[str, Any]]:
    """Override entries as plain data (the list :func:`dump_overrides` writes)."""
    out = []
    for e in load_overrides(entries):
        path = e.source or "overrides"
        item: dict[str, Any] = {"match": e.match}
        if e.when is not None:
            item["when"] = e.when
        item.update(
            _spec_to_data(
                e.spec, path, OverrideError, fields=OVERRIDE_FIELDS, internals=False, strict=True
            )
        )
        out.append(item)
    return out


def dump_overrides(entries: OverridesLike) -> str:
    """Override entries as a YAML ``{overrides: [...]}`` document that :func:`load_overrides` reads back."""
    return _yaml_dump({"overrides": overrides_to_list(entries)}, OverrideError)


# ----------------------------------------------------------------- resolution


def is_glob(pattern: str) -> bool:
    """Whether an override key is a glob (contains ``*``, ``?`` or ``[``) rather than an exact FQN."""
    return any(c in pattern for c in "*?[")


def compile_glob(pattern: str, *, path: str = "match") -> re.Pattern[str]:
    """Translate an FQN glob into a regex for ``fullmatch``: ``*`` (crosses dots), ``?``, ``[...]``, ``[!...]``."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            if not out or out[-1] != ".*":
                out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[":
            j = i
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:  # no closing bracket: a literal '['
                out.append(re.escape(c))
                continue
            body, i = pattern[i:j], j + 1
            negate = body.startswith("!")
            if negate:
                body = body[1:]
            chars = [
                "-" if ch == "-" and 0 < k < len(body) - 1 else re.escape(ch)
                for k, ch in enumerate(body)
            ]
            out.append(("[^" if negate else "[") + "".join(chars) + "]")
        else:
            out.append(re.escape(c))
    try:
        return re.compile("".join(out), re.DOTALL)
    except re.error as e:
        raise OverrideError(
            f"{path}: {pattern!r} is not a valid glob ({e}). Check its [...] ranges."
        ) from None


def _iter_axes(spec: ModuleShardingSpec, prefix: str) -> Iterator[tuple[str, str]]:
    for name in _LAYOUT_FIELDS:
        value = getattr(spec, name)
        if isinstance(value, Mapping):
            for key, named in value.items():
                if isinstance(named, Mapping):
                    for axis in named:
                        yield f"{prefix}.{name}.{key}.{axis}", str(axis)


def _validate_entry(
    entry: OverrideEntry,
    mesh_axes: tuple[str, ...],
    module_set: set[str],
    module_names: Sequence[str],
) -> re.Pattern[str] | None:
    source = entry.source or "overrides"
    for name in _LAYOUT_FIELDS:  # a spec's fields can be assigned after construction: check again
        value = getattr(entry.spec, name)
        for key, named in value.items() if isinstance(value, Mapping) else ():
            for axis, p in named.items() if isinstance(named, Mapping) else ():
                try:
                    check_lowerable(p, path=f"{source}.{name}.{key}.{axis}", module=entry.match)
                except UnsupportedPartialError as e:
                    raise OverrideError(str(e)) from e
    for path, axis in _iter_axes(entry.spec, source):
        if axis.startswith("dp"):
            raise OverrideError(
                f"{path}: placement on data-parallel axis {axis!r}. dp stays outside the plan: "
                "FSDP/DDP own it and a plan describes one dp slice. Remove this axis from the "
                f"override and apply FSDP/DDP over the {axis!r} mesh dimension after hp."
            )
        if axis in mesh_axes or axis in CANONICAL_AXES:
            continue
        best = close_matches(axis, mesh_axes, n=1) or close_matches(axis, CANONICAL_AXES, n=1)
        hint = f" Did you mean {best[0]!r}?" if best else ""
        raise OverrideError(
            f"{path}: mesh axis {axis!r} is neither a dimension of the mesh {mesh_axes} nor a "
            f"canonical axis name.{hint} Use one of the mesh's dimension names."
        )
    if is_glob(entry.match):
        return compile_glob(entry.match, path=f"{source}.match")
    if entry.match not in module_set:
        close = close_matches(entry.match, module_names, n=3)
        hint = (
            f" Close matches: {', '.join(repr(c) for c in close)}."
            if close
            else " No module has a similar name."
        )
        raise OverrideError(
            f"{source}.match: {entry.match!r} is not a module of the model.{hint} An exact key "
            "must name a module from model.named_modules(); use a glob (*, ?, [...]) to match several."
        )
    return None


def resolve_overrides(
    derived: Mapping[str, ModuleShardingSpec],
    overrides: OverridesLike,
    *,
    module_names: Sequence[str],
    active: Iterable[str],
    mesh_axis_names: Sequence[str],
) -> tuple[dict[str, ModuleShardingSpec], list[str]]:
    """Merge user overrides into the derived boundaries (SPEC 2.3 "Override keys").

    Every entry is validated first (spec values, mesh axes, no dp, exact FQNs exist).
    Entries whose ``when`` axis is not in ``active`` are skipped. An exact key merges into
    the boundary there or inserts a new one (full contract required); a glob merges into
    every matching derived boundary in model order and warns when it matches none.
    Entries apply in list order. Returns the new specs in model order and the merge notes;
    neither ``derived`` nor the override specs are mutated.
    """
    entries = load_overrides(overrides)
    order = [str(n) for n in module_names]
    module_set = set(order)
    mesh_axes = tuple(str(a) for a in mesh_axis_names)
    active_set = {str(a) for a in active}
    for fqn, spec in derived.items():
        if fqn not in module_set:
            raise PlanError(
                f"derived boundary {fqn!r} is not in module_names; pass model.named_modules() names."
            )
        if not isinstance(spec, ModuleShardingSpec):
            raise PlanError(f"derived[{fqn!r}]: expected a ModuleShardingSpec, got {_tname(spec)}.")
    patterns = [_validate_entry(e, mesh_axes, module_set, order) for e in entries]

    state = {fqn: copy_spec(derived[fqn]) for fqn in order if fqn in derived}
    derived_order = list(state)
    notes: list[str] = []

    def merge_into(fqn: str, entry: OverrideEntry, source: str) -> None:
        merged, merge_notes = merge_specs(state[fqn], entry.spec, fqn=fqn)
        state[fqn] = copy_spec(merged)
        notes.extend(f"{source}: {note}" for note in merge_notes)

    for entry, pattern in zip(entries, patterns, strict=True):
        source = entry.source or "overrides"
        if entry.when is not None and entry.when not in active_set:
            notes.append(
                f"{source}: skipped ({entry.match!r} when: {entry.when}; {entry.when} is not active)"
            )
            continue
        if pattern is None:
            if entry.match in state:
                merge_into(entry.match, entry, source)
                continue
            try:
                state[entry.match] = copy_spec(finalize_insert(entry.spec, fqn=entry.match))
            except IncompleteContractError as e:
                raise IncompleteOverrideError(f"{source}: {e}") from e
            notes.append(f"{source}: inserted a new boundary at {entry.match!r}")
            continue
        hits = [fqn for fqn in derived_order if pattern.fullmatch(fqn)]
        if hits:
            for fqn in hits:
                merge_into(fqn, entry, source)
            continue
        modules_hit = [n for n in order if pattern.fullmatch(n)]
        if modules_hit:
            why = (
                f"; it matches {len(modules_hit)} module(s) (e.g. {modules_hit[0]!r}) that are not "
                "boundaries: insert one with an exact FQN and a full contract"
            )
        else:
            close = close_matches(entry.match, derived_order, n=2)
            why = "; check the pattern ('*' crosses dots)" + (
                f", close boundaries: {', '.join(repr(c) for c in close)}" if close else ""
            )
        message = f"{source}: glob {entry.match!r} matched no derived boundary{why}."
        warnings.warn(message, OverrideMatchWarning, stacklevel=2)
        notes.append(message)
    return {fqn: state[fqn] for fqn in order if fqn in state}, notes
