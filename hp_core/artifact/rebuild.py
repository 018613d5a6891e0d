"""``rebuild(meta) -> ShardingPlan``: the inverse of ``freeze``, by walking ``SPEC_FIELDS``.

Every value goes through the rebuild kind of its row (:data:`REBUILDERS`) and then
through ``ModuleShardingSpec``'s own validation. A meta must be canonical, i.e. exactly
what ``freeze`` writes for the plan it describes, so ``freeze(rebuild(meta)) == meta``
holds for every meta that rebuild accepts; anything else is a :class:`MetaError` that
names the first offending path.

Exempt fields are not in a meta and come back at their defaults. The one the applier
needs, the tp-local attribute plan (head counts divided by tp), depends on the model's
attribute values: pass ``model=`` (or call :func:`restore_model_metadata`) to re-derive
it exactly as the planner does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from hp_core.artifact.freeze import FreezeError, freeze, json_value
from hp_core.errors import HpError
from hp_core.injection import Target, TargetError
from hp_core.mesh import MeshSpec
from hp_core.planner.lints import compute_tp_local_attrs
from hp_core.plans.errors import PlanError
from hp_core.plans.model import ShardingPlan
from hp_core.plans.providers import PROVIDERS_KEY, providers_from_data
from hp_core.spec.fields import (
    DERIVED_FIELDS,
    FROZEN_GROUPS,
    MATCH_KEY,
    PARAM_PLAN,
    SpecField,
    fields_in_group,
)
from hp_core.spec.keywords import close_matches
from hp_core.spec.module_spec import ModuleShardingSpec
from hp_core.spec.placements import PlacementSyntaxError, SpecValidationError, parse_named_placement

__all__ = [
    "MISSING",
    "PLAN_KEYS",
    "REBUILDERS",
    "MetaError",
    "ModelMismatchError",
    "rebuild",
    "restore_model_metadata",
]

#: Top-level keys of a meta besides the rule groups.
PLAN_KEYS: tuple[str, ...] = ("mesh", "sequence_parallel", "loss_parallel", "ep_size")
_MESH_KEYS = ("axis_names", "shape")


class MetaError(HpError, ValueError):
    """A meta that rebuild cannot turn into a plan, or that is not canonical."""


class ModelMismatchError(HpError, ValueError):
    """A plan names a module the model does not have."""


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


#: What a rebuilder receives for a key the rule does not have.
MISSING: Any = _Missing()


# ------------------------------------------------------------------ the kinds


def _layout_map(raw: Any, path: str) -> Any:
    if raw is MISSING:
        return None
    if not isinstance(raw, Mapping):
        raise MetaError(f"{path}: expected a mapping of name to {{axis: placement}}, got {raw!r}.")
    out = {}
    for key, named in raw.items():
        if not isinstance(key, str) or not key:
            raise MetaError(f"{path}: keys must be non-empty strings, got {key!r}.")
        try:
            out[key] = parse_named_placement(named, path=f"{path}.{key}")
        except PlacementSyntaxError as e:
            raise MetaError(str(e)) from None
    return out


def _names(raw: Any, path: str) -> list[str]:
    if not isinstance(raw, list):
        raise MetaError(f"{path}: expected a list of names, got {raw!r}.")
    for i, item in enumerate(raw):
        if not isinstance(item, str) or not item:
            raise MetaError(f"{path}[{i}]: expected a non-empty string, got {item!r}.")
    return list(raw)


def _name_list(raw: Any, path: str) -> Any:
    return None if raw is MISSING else _names(raw, path)


def _tuple_empty(raw: Any, path: str) -> tuple[str, ...]:
    return () if raw is MISSING else tuple(_names(raw, path))


def _bool_default_true(raw: Any, path: str) -> bool:
    if raw is MISSING:
        return True
    if not isinstance(raw, bool):
        raise MetaError(f"{path}: expected true or false, got {raw!r}.")
    return raw


def _opt_scalar(raw: Any, path: str) -> Any:
    if raw is MISSING:
        return None
    if not isinstance(raw, (bool, int, float, str)):
        raise MetaError(f"{path}: expected a boolean, number or string, got {raw!r}.")
    return raw


def _injection_target(raw: Any, path: str) -> Any:
    if raw is MISSING:
        return None
    if isinstance(raw, str):
        return raw
    if isinstance(raw, Mapping) and "_target_" in raw:
        try:
            return Target.from_dict(_json(raw, path), path=path)
        except TargetError as e:
            raise MetaError(str(e)) from None
    if isinstance(raw, Mapping):
        return _layout_map(raw, path)
    raise MetaError(
        f"{path}: expected a registry name, {{_target_: NAME_OR_PATH, ...}} or a layout, got "
        f"{raw!r}."
    )


def _json(raw: Any, path: str) -> Any:
    try:
        return json_value(raw, path)
    except FreezeError as e:
        raise MetaError(str(e)) from None


def _dict_copy(raw: Any, path: str) -> dict[str, Any]:
    if raw is MISSING:
        return {}
    if not isinstance(raw, Mapping):
        raise MetaError(f"{path}: expected a mapping, got {raw!r}.")
    return dict(_json(raw, path))


def _int_truthy(raw: Any, path: str) -> int:
    if raw is MISSING:
        return 0
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise MetaError(f"{path}: expected a non-negative integer, got {raw!r}.")
    return raw


#: Rebuild kind → ``(raw or MISSING, path) -> value``.
REBUILDERS: Mapping[str, Callable[[Any, str], Any]] = {
    "placement_map": _layout_map,
    "named_placements": _layout_map,
    "name_list": _name_list,
    "attr_list": _name_list,
    "bool_default_true": _bool_default_true,
    "opt_scalar": _opt_scalar,
    "tuple_empty": _tuple_empty,
    "injection_target": _injection_target,
    "dict_copy": _dict_copy,
    "int_truthy": _int_truthy,
}

_CONSTRUCTOR_ARGS = frozenset(f.name for f in dataclasses.fields(ModuleShardingSpec) if f.init)
_DERIVED_NAMES = {r.name: r.record_name for r in DERIVED_FIELDS}


# ------------------------------------------------------------------ the walk


def _rules(meta: Mapping[str, Any], group: str) -> dict[str, tuple[str, Mapping[str, Any]]]:
    """``fqn → (path, rule)`` of one group, checking each rule's shape and keys."""
    raw = meta[group]
    if not isinstance(raw, list):
        raise MetaError(
            f"{group}: expected a list of {{{MATCH_KEY}: FQN, ...}} rules, got {raw!r}."
        )
    rows = fields_in_group(group)
    valid = (MATCH_KEY, *(str(r.key) for r in rows))
    out: dict[str, tuple[str, Mapping[str, Any]]] = {}
    for i, rule in enumerate(raw):
        where = f"{group}[{i}]"
        if isinstance(rule, Mapping) and MATCH_KEY in rule and not isinstance(rule[MATCH_KEY], str):
            value = rule[MATCH_KEY]
            raise MetaError(
                f"{where}.{MATCH_KEY}: expected a string (a module FQN), got "
                f"{type(value).__name__} {value!r}."
            )
        if not isinstance(rule, Mapping) or not isinstance(rule.get(MATCH_KEY), str):
            raise MetaError(
                f"{where}: expected a mapping with a string {MATCH_KEY!r} (a module FQN), got "
                f"{rule!r}."
            )
        fqn = rule[MATCH_KEY]
        where = f"{where} ({fqn!r})"
        if fqn in out:
            raise MetaError(
                f"{where}: a second rule for {fqn!r} in {group}; each module has at most one."
            )
        for key in rule:
            if key not in valid:
                raise MetaError(
                    f"{where}: unknown key {key!r}.{_key_hint(key, group, valid)} Valid keys: "
                    f"{', '.join(valid)}."
                )
        out[fqn] = (where, rule)
    return out


def _key_hint(key: Any, group: str, valid: tuple[str, ...]) -> str:
    """Where a misplaced meta key belongs, or the closest valid one."""
    for other in FROZEN_GROUPS:
        if other != group and any(r.key == key for r in fields_in_group(other)):
            return f" It belongs in {other}."
    best = close_matches(str(key), valid, n=1)
    return f" Did you mean {best[0]!r}?" if best else ""


def _fill(
    values: dict[str, Any], rows: tuple[SpecField, ...], rule: Mapping[str, Any], where: str
) -> None:
    for row in rows:
        raw = rule.get(str(row.key), MISSING)
        values[row.name] = REBUILDERS[str(row.rebuild)](raw, f"{where}.{row.key}")


def _spec(values: Mapping[str, Any], where: str) -> ModuleShardingSpec:
    try:
        spec = ModuleShardingSpec(**{k: v for k, v in values.items() if k in _CONSTRUCTOR_ARGS})
    except (SpecValidationError, PlacementSyntaxError, TargetError) as e:
        message = str(e).removeprefix("ModuleShardingSpec.")
        raise MetaError(f"{where}: {message}") from None
    spec.with_derived(**{_DERIVED_NAMES[k]: v for k, v in values.items() if k in _DERIVED_NAMES})
    return spec


def _first_difference(a: Any, b: Any, keys: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
    """The key path of the first place where ``a`` and ``b`` differ (None when equal)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in [*a, *(k for k in b if k not in a)]:
            if key not in a or key not in b:
                return (*keys, key)
            found = _first_difference(a[key], b[key], (*keys, key))
            if found is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _first_difference(x, y, (*keys, i))
            if found is not None:
                return found
        return None
    return None if (type(a) is type(b) and a == b) else keys


def _at(data: Any, keys: tuple[Any, ...]) -> Any:
    for key in keys:
        if isinstance(data, Mapping) and key in data:
            data = data[key]
        elif isinstance(data, list) and isinstance(key, int) and key < len(data):
            data = data[key]
        else:
            return MISSING
    return data


def _path(keys: tuple[Any, ...]) -> str:
    return "meta" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys)


def rebuild(meta: Mapping[str, Any], *, model: nn.Module | None = None) -> ShardingPlan:
    """The plan a meta describes (inverse of :func:`hp_core.artifact.freeze`).

    With ``model``, also re-derives the model-dependent exempt metadata
    (:func:`restore_model_metadata`).
    """
    if not isinstance(meta, Mapping):
        raise MetaError(f"meta: expected a mapping, got {type(meta).__name__}.")
    valid = (*PLAN_KEYS, *FROZEN_GROUPS)
    for key in meta:
        if key == PROVIDERS_KEY:  # optional: an artifact frozen before hp recorded providers
            continue
        if key not in valid:
            best = close_matches(str(key), valid, n=1)
            hint = f" Did you mean {best[0]!r}?" if best else ""
            raise MetaError(f"meta: unknown key {key!r}.{hint} Valid keys: {', '.join(valid)}.")
    missing = [k for k in valid if k not in meta]
    if missing:
        raise MetaError(
            f"meta: missing key(s) {', '.join(missing)}; a meta is what freeze(plan) returns."
        )
    groups = {g: _rules(meta, g) for g in FROZEN_GROUPS}
    modules: dict[str, ModuleShardingSpec] = {}
    for fqn, (module_path, _) in groups[PARAM_PLAN].items():
        values: dict[str, Any] = {}
        for group in FROZEN_GROUPS:
            where, rule = groups[group].get(fqn, (module_path, {}))
            _fill(values, fields_in_group(group), rule, where)
        modules[fqn] = _spec(values, module_path)
    for group in FROZEN_GROUPS:
        for fqn, (where, _) in groups[group].items():
            if fqn not in modules:
                raise MetaError(
                    f"{where}: {fqn!r} has no {PARAM_PLAN} rule; every planned module has one."
                )
    mesh = meta["mesh"]
    if (
        not isinstance(mesh, Mapping)
        or "axis_names" not in mesh
        or any(k not in _MESH_KEYS for k in mesh)
    ):
        raise MetaError(f"mesh: expected {{axis_names: [...], shape: [...]}}, got {mesh!r}.")
    names, shape = mesh["axis_names"], mesh.get("shape")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise MetaError(
            "mesh.axis_names: expected a list of axis names such as [tp, cp], got "
            f"{type(names).__name__} {names!r}."
        )
    if shape is not None and (
        not isinstance(shape, list)
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape)
    ):
        raise MetaError(
            f"mesh.shape: expected a list of axis sizes such as [4, 2], got {type(shape).__name__} "
            f"{shape!r}."
        )
    try:
        plan = ShardingPlan(
            modules=modules,
            mesh_axis_names=mesh["axis_names"],
            mesh_shape=mesh.get("shape"),
            sequence_parallel=meta["sequence_parallel"],
            loss_parallel=meta["loss_parallel"],
            ep_size=meta["ep_size"],
            providers=(
                providers_from_data(meta[PROVIDERS_KEY], MetaError) if PROVIDERS_KEY in meta else {}
            ),
        )
    except PlanError as e:
        raise MetaError(str(e).removeprefix("ShardingPlan.")) from None
    try:
        canonical = freeze(plan)
    except FreezeError as e:  # e.g. outputs ordered only by a map's key order
        raise MetaError(str(e)) from None
    # The providers record where the plan was made, not the plan: not compared.
    canonical.pop(PROVIDERS_KEY, None)
    diff = _first_difference({k: v for k, v in meta.items() if k != PROVIDERS_KEY}, canonical)
    if diff is not None:
        got, want = _at(meta, diff), _at(canonical, diff)
        raise MetaError(
            f"{_path(diff)}: not in canonical form: the meta has {got!r} where freeze writes "
            f"{want!r}. An artifact is written by hp freeze and never edited; re-create it instead."
        )
    if model is not None:
        restore_model_metadata(plan, model)
    return plan


def restore_model_metadata(plan: ShardingPlan, model: nn.Module) -> ShardingPlan:
    """Re-derive, in place, the exempt metadata the applier reads from the model.

    That is the tp-local attribute plan (head-count attributes and ``tp_divide_attrs``,
    ``(global, local)`` per attribute), computed by the planner's own function. Returns
    ``plan``.
    """
    names = {n for n, _ in model.named_modules()}
    absent = [fqn for fqn in plan if fqn not in names]
    if absent:
        close = close_matches(absent[0], names, n=1)
        hint = f" Closest module: {close[0]!r}." if close else ""
        raise ModelMismatchError(
            f"the plan names module(s) the model lacks: {absent[:5]}.{hint} Was it made for "
            "another model?"
        )
    if plan.mesh_shape is None or "tp" not in plan.mesh_axis_names:
        return plan
    mesh = MeshSpec(plan.mesh_axis_names, plan.mesh_shape)
    if mesh.size("tp") > 1:
        for fqn, spec in plan.items():
            spec.with_derived(tp_local_attr_plan=compute_tp_local_attrs(model, fqn, spec, mesh))
    return plan
