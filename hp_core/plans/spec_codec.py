"""One ``ModuleShardingSpec`` <-> plain data: the per-module part of a plan document.

Placements become DSL strings, injected callables ``{_target_: module.qualname}``, and the
planner-derived record goes under ``_internal:``. Reading checks every value (by the value
kind of its row in :data:`~hp_core.spec.fields.SPEC_FIELDS`) and names its path; the spec
is then built from the checked values without a second check.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch.distributed.tensor import Placement

from hp_core.injection import Target, TargetError
from hp_core.plans.errors import PlanError, PlanYAMLError
from hp_core.spec.derived import Derived
from hp_core.spec.fields import AUTO, LAYOUT_FIELDS, NONE, RUNTIME_FIELDS, SPEC_FIELDS_BY_NAME
from hp_core.spec.keywords import close_matches, did_you_mean
from hp_core.spec.module_spec import ModuleShardingSpec, copy_value, spec_from_checked
from hp_core.spec.placements import (
    PlacementSyntaxError,
    UnsupportedPartialError,
    check_lowerable,
    format_placement,
    parse_named_placement,
    parse_placement,
)

if TYPE_CHECKING:
    from hp_core.plans.model import ShardingPlan

__all__ = [
    "INTERNAL_FIELDS",
    "LAYOUT_FIELDS",
    "OVERRIDE_FIELDS",
    "PLAN_FORMAT_VERSION",
    "USER_FIELDS",
    "apply_internals",
    "build_spec",
    "check_keys",
    "is_int",
    "parse_bool",
    "plan_data",
    "short",
    "spec_to_data",
    "tname",
]

#: Version of the YAML/dict plan document written by :func:`hp_core.plans.dump_plan`.
PLAN_FORMAT_VERSION = 1

#: User fields of ModuleShardingSpec, in dataclass order (the key order of a dumped spec).
USER_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(ModuleShardingSpec)
    if f.name in SPEC_FIELDS_BY_NAME and SPEC_FIELDS_BY_NAME[f.name].source == "user"
)
#: Fields a user override may set (``skip_source_lowering`` belongs to codegen).
OVERRIDE_FIELDS = tuple(n for n in USER_FIELDS if SPEC_FIELDS_BY_NAME[n].override)
#: Internal fields written under a module's ``_internal:`` mapping (YAML key -> attribute),
#: in the order of the Derived record.
INTERNAL_FIELDS = {f.name: f"_{f.name}" for f in dataclasses.fields(Derived)}
_LAYOUT_KINDS = ("placement_map", "out_map", "inner_out")


def tname(value: Any) -> str:
    """The type name of ``value``, for messages."""
    return type(value).__name__


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


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
        raise err(f"{path}: expected an {{axis: placement}} mapping, got {tname(named)} {named!r}.")
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
        return {"_target_": value.target, **copy_value(value.config)}
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
    kind = SPEC_FIELDS_BY_NAME[name].kind
    if isinstance(value, str) or kind in ("bool", "opt_bool", "inner_target"):
        return value  # sentinels, 'first_input', booleans, inner target names
    if kind in _LAYOUT_KINDS:
        if not isinstance(value, Mapping):
            raise err(f"{path}: expected a mapping of name to {{axis: placement}}, got {value!r}.")
        return {str(k): _layout_to_data(v, f"{path}.{k}", err) for k, v in value.items()}
    if kind == "name_list":
        return [str(v) for v in value]
    return _injection_to_data(value, path, err, strict)


def spec_to_data(
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
    if spec._fused_layouts:
        out["fused_layouts"] = {str(k): dict(v) for k, v in spec._fused_layouts.items()}
    return out


# ---------------------------------------------------------- plain data → spec


def check_keys(
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
                f"{path}: keys must be strings, got {tname(key)} {key!r}. Valid keys: "
                f"{', '.join(valid)}."
            )
        if key in valid:
            continue
        if special and key in special:
            raise err(f"{path}.{key}: {special[key]}")
        if internal_hint and key.startswith("_"):
            raise err(f"{path}.{key}: {internal_hint}")
        raise err(
            f"{path}: unknown key {key!r}.{did_you_mean(key, valid)} Valid keys: "
            f"{', '.join(valid)}."
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
    # Placement objects (Partial('max')) from Python: the DSL parser lets them through.
    for axis, p in named.items():
        try:
            check_lowerable(p, path=f"{path}.{axis}", module=module)
        except UnsupportedPartialError as e:
            raise err(str(e)) from e
    return named


def _parse_layout_map(
    raw: Any,
    name: str,
    path: str,
    err: type[PlanError],
    *,
    sentinels: bool,
    module: str | None = None,
) -> Any:
    out_like = SPEC_FIELDS_BY_NAME[name].kind in ("out_map", "inner_out")
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
            f"Otherwise write a mapping, e.g. {name}: {SPEC_FIELDS_BY_NAME[name].example}."
        )
    if not isinstance(raw, Mapping):
        raise err(
            f"{path}: expected a mapping of name to {{axis: placement}}, got {tname(raw)} {raw!r}. "
            f"Example: {name}: {SPEC_FIELDS_BY_NAME[name].example}."
        )
    if out_like and raw and all(isinstance(v, (str, Placement)) for v in raw.values()):
        return {"output": _parse_layout(raw, path, err, module)}  # scalar shorthand {tp: ...}
    out: dict[str, dict[str, Placement]] = {}
    for key, named in raw.items():
        if not isinstance(key, str) or not key:
            raise err(
                f"{path}: keys must be non-empty strings (parameter paths or input/output names), "
                f"got {key!r}. Example: {name}: {SPEC_FIELDS_BY_NAME[name].example}."
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
        raise err(f"{path}: expected a list of names, got {tname(raw)} {raw!r}.")
    for i, item in enumerate(raw):
        if not isinstance(item, str) or not item:
            raise err(f"{path}[{i}]: expected a non-empty string, got {item!r}.")
    return list(raw)


def parse_bool(raw: Any, path: str, err: type[PlanError], *, optional: bool) -> bool | None:
    if isinstance(raw, bool) or (optional and raw is None):
        return raw
    allowed = "true, false or null" if optional else "true or false"
    raise err(f"{path}: expected {allowed}, got {tname(raw)} {raw!r}.")


def _parse_injection(raw: Any, path: str, err: type[PlanError]) -> Any:
    if isinstance(raw, str):
        if not raw.strip():
            raise err(
                f"{path}: an empty string names no registry item. Write a registry name or "
                "{_target_: ...}."
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
                f"{path}: a mapping here must name what it refers to with _target_.{hint} Write "
                f"{{_target_: NAME_OR_DOTTED_PATH, config_key: value, ...}}, got {dict(raw)!r}."
            )
        try:
            return Target.from_dict(raw, path=path)
        except TargetError as e:
            raise err(str(e)) from e
    if callable(raw):
        return raw
    raise err(
        f"{path}: expected a registry name (string), {{_target_: ...}} or a decorated function, "
        f"got {tname(raw)} {raw!r}."
    )


def _parse_field(
    name: str, raw: Any, path: str, err: type[PlanError], *, module: str | None = None
) -> Any:
    kind = SPEC_FIELDS_BY_NAME[name].kind
    if kind == "bool":
        return parse_bool(raw, path, err, optional=False)
    if raw is None:
        return None
    if kind in ("placement_map", "out_map"):
        return _parse_layout_map(raw, name, path, err, sentinels=True, module=module)
    if kind == "name_list":
        return _parse_names(raw, path, err)
    if kind == "opt_bool":
        return parse_bool(raw, path, err, optional=True)
    if kind == "inner_target":
        if isinstance(raw, str) and raw.strip():
            return raw
        raise err(f"{path}: expected 'self' or the attribute name of a child module, got {raw!r}.")
    if kind == "inner_out":
        if raw == "first_input":
            return raw
        return _parse_layout_map(raw, name, path, err, sentinels=False, module=module)
    return _parse_injection(raw, path, err)


def build_spec(
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
    return spec_from_checked(kwargs)  # every value is checked above, once


def apply_internals(spec: ModuleShardingSpec, raw: Any, path: str) -> None:
    err = PlanYAMLError
    if not isinstance(raw, Mapping):
        raise err(f"{path}: expected a mapping of internal fields, got {tname(raw)} {raw!r}.")
    valid = tuple(INTERNAL_FIELDS)
    runtime = {
        key: "runtime introspection written by apply(); it is not part of a plan file. Remove it."
        for n in RUNTIME_FIELDS
        for key in (n, n.lstrip("_"))
    }
    check_keys(
        raw,
        path,
        err,
        valid,
        internal_hint="write internal keys without the leading underscore.",
        special=runtime,
    )
    facts: dict[str, Any] = {}
    for key, value in raw.items():
        where = f"{path}.{key}"
        if key == "tp_local_attr_plan":
            parsed: Any = None
            if value is not None:
                if not isinstance(value, Mapping):
                    raise err(
                        f"{where}: expected a mapping of attribute name to [global, local], got "
                        f"{value!r}."
                    )
                parsed = {}
                for attr, pair in value.items():
                    if not isinstance(attr, str) or not (
                        isinstance(pair, (list, tuple))
                        and len(pair) == 2
                        and all(is_int(x) for x in pair)
                    ):
                        raise err(
                            f"{where}.{attr}: expected a pair of integers [global, local], got "
                            f"{pair!r}."
                        )
                    parsed[attr] = (pair[0], pair[1])
        elif key == "deferred_bias_params":
            if isinstance(value, str):
                raise err(f"{where}: expected a list of parameter paths, got {value!r}.")
            parsed = tuple(_parse_names(value, where, err)) if value is not None else ()
        elif key in ("is_terminal", "needs_cp_attn"):
            parsed = parse_bool(value, where, err, optional=False)
        elif key == "ep_stack":
            if not isinstance(value, Mapping):
                raise err(
                    f"{where}: expected a mapping of stacked path to [source paths], got {value!r}."
                )
            parsed = {}
            for stacked, sources in value.items():
                if not isinstance(stacked, str) or isinstance(sources, str):
                    raise err(
                        f"{where}.{stacked}: expected a list of source parameter paths, got "
                        f"{sources!r}."
                    )
                parsed[stacked] = _parse_names(sources, f"{where}.{stacked}", err)
        elif key == "fused_layouts":
            if not isinstance(value, Mapping) or not all(
                isinstance(v, Mapping) for v in value.values()
            ):
                raise err(
                    f"{where}: expected a mapping of parameter path to a layout, got {value!r}."
                )
            parsed = {str(k): dict(v) for k, v in value.items()}
        else:  # ep_size
            if not is_int(value) or value < 0:
                raise err(f"{where}: expected a non-negative integer, got {value!r}.")
            parsed = value
        facts[key] = parsed
    spec.with_derived(**facts)


# ------------------------------------------------------------- the plan


def plan_data(plan: ShardingPlan, *, strict: bool) -> dict[str, Any]:
    """The plan document of ``plan`` (``strict``: refuse callables that cannot be named)."""
    mesh: dict[str, Any] = {"axis_names": list(plan.mesh_axis_names)}
    if plan.mesh_shape is not None:
        mesh["shape"] = list(plan.mesh_shape)
    modules = {
        fqn: spec_to_data(
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
