"""``freeze(plan) -> meta``: a plan as JSON-safe plain data, by walking ``SPEC_FIELDS``.

A meta holds the plan-level fields (mesh axis names and shape, sequence_parallel,
loss_parallel, ep_size; ``providers``, the distribution of each registry item it names,
when there are any: :mod:`hp_core.plans.providers`) and, per frozen group of the table,
a list of ``{match: FQN, ...}`` rules in model order: ``param_plan`` has one rule per
module, ``injections`` one per module that has any injection field to write. Inside a
rule, keys follow the table and values come from the freeze kind of their row
(:data:`FREEZERS`); nothing here knows a particular field.

Value forms: placements are DSL strings (``"shard(1)"``, ``"replicate"``, ``"partial"``)
under their axis; a registry name stays a name (``"sdpa_hf"``); a ``Target`` becomes
``{_target_: NAME_OR_PATH, key: value, ...}``; a decorated callable becomes the Target
``{_target_: "module.qualname"}`` (it must be a module-level function of an importable
module, and rebuild gives back that Target, which apply imports only from trusted
packages).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

from hp_core.errors import HpError
from hp_core.injection import InjectionMeta, Target
from hp_core.plans.model import ShardingPlan
from hp_core.plans.providers import PROVIDERS_KEY, providers_data, record_providers
from hp_core.spec.fields import FROZEN_GROUPS, MATCH_KEY, PARAM_PLAN, fields_in_group
from hp_core.spec.module_spec import ModuleShardingSpec
from hp_core.spec.placements import PlacementSyntaxError, format_placement, parse_placement

__all__ = ["FREEZERS", "FreezeError", "callable_target", "freeze", "json_value"]


class FreezeError(HpError, ValueError):
    """A plan value that has no frozen form (the message names the module and field)."""


def json_value(value: Any, path: str) -> Any:
    """A deep copy of ``value`` that JSON writes and reads back unchanged, or a FreezeError.

    Allowed: dicts with string keys, lists, strings, finite floats, ints, bools and None.
    Tuples are refused: JSON would read them back as lists.
    """
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise FreezeError(f"{path}: {value!r} has no JSON form; use a finite number.")
        return value
    if isinstance(value, list):
        return [json_value(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise FreezeError(f"{path}: keys must be strings, got {type(k).__name__} {k!r}.")
            out[k] = json_value(v, f"{path}.{k}")
        return out
    hint = " Use a list (JSON has no tuples)." if isinstance(value, tuple) else ""
    raise FreezeError(
        f"{path}: {type(value).__name__} {value!r} has no JSON form; an artifact holds strings, "
        f"numbers, booleans, null, lists and string-keyed mappings.{hint}"
    )


def callable_target(fn: Any, path: str) -> str:
    """The dotted ``module.qualname`` naming a decorated callable, checked to resolve back to it."""
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    if not isinstance(getattr(fn, "_injection_meta", None), InjectionMeta):
        raise FreezeError(
            f"{path}: {name} is not decorated with @local_compute or @inner_wrapper, so it cannot "
            "be injected; decorate it (from hp_core)."
        )
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    owner = sys.modules.get(module) if isinstance(module, str) else None
    if (
        owner is None
        or module == "__main__"
        or not isinstance(qual, str)
        or "." in qual
        or "<" in qual
        or getattr(owner, qual, None) is not fn
    ):
        raise FreezeError(
            f"{path}: {name} cannot be named in an artifact: only a module-level function of an "
            "importable module (not __main__, a lambda, a nested function or a method) has a "
            "dotted path that resolves back to it. Move it to module level, or register it under "
            "a name (register_inner_wrapper / register_compute_factory or a plugin) and use the "
            "name."
        )
    return f"{module}.{qual}"


# ------------------------------------------------------------------ the kinds


def _layout(named: Any, path: str) -> dict[str, str]:
    if not isinstance(named, Mapping) or not named:
        raise FreezeError(
            f"{path}: expected a non-empty {{axis: placement}} mapping, got {named!r}."
        )
    out: dict[str, str] = {}
    for axis, p in named.items():
        where = f"{path}.{axis}"
        try:
            out[str(axis)] = format_placement(parse_placement(p, path=where))
        except PlacementSyntaxError as e:
            message = str(e)
            raise FreezeError(
                message if message.startswith(where) else f"{where}: {message}"
            ) from None
    return out


def _layout_map(value: Any, path: str) -> dict[str, dict[str, str]]:
    if not isinstance(value, Mapping):
        sentinel = (
            " (an unresolved override sentinel: freeze a finished plan, from plan())"
            if isinstance(value, str)
            else ""
        )
        raise FreezeError(
            f"{path}: expected a mapping of name to {{axis: placement}}, got {value!r}{sentinel}."
        )
    return {str(k): _layout(v, f"{path}.{k}") for k, v in value.items()}


def _names(value: Any, path: str) -> list[str]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise FreezeError(f"{path}: expected a list of names, got {value!r}.")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise FreezeError(f"{path}[{i}]: expected a string, got {item!r}.")
    return list(value)


def _scalar(value: Any, path: str) -> Any:
    if isinstance(value, (bool, int, float, str)):
        return json_value(value, path)
    raise FreezeError(f"{path}: expected a boolean, number or string, got {value!r}.")


def _int_truthy(value: Any, path: str) -> Any:
    if isinstance(value, int):  # bool included: a flag freezes as true
        return value
    raise FreezeError(f"{path}: expected an integer or a boolean, got {value!r}.")


def _plain(value: Any, path: str) -> Any:
    return json_value(value, path)


def _value_to_dict(value: Any, path: str) -> Any:
    if isinstance(value, str):
        return value  # a registry name, or a keyword such as 'first_input'
    if isinstance(value, Target):
        return json_value(value.to_dict(), path)
    if isinstance(value, Mapping):
        return _layout_map(value, path)
    if callable(value):
        return {"_target_": callable_target(value, path)}
    raise FreezeError(
        f"{path}: expected a registry name, a Target, a decorated function or a layout, got "
        f"{value!r}."
    )


def _dict_copy(value: Any, path: str) -> Any:
    if not isinstance(value, Mapping):
        raise FreezeError(f"{path}: expected a mapping, got {value!r}.")
    return json_value(value, path)


#: Freeze kind → ``(value, path) -> JSON value``; called only when the row's write condition holds.
FREEZERS: Mapping[str, Callable[[Any, str], Any]] = {
    "placement_map": _layout_map,
    "named_placements": _layout_map,
    "name_list": _names,
    "attr_list": _names,
    "scalar": _scalar,
    "int_truthy": _int_truthy,
    "plain": _plain,
    "value_to_dict": _value_to_dict,
    "dict_copy": _dict_copy,
}


def _check_output_order(fqn: str, spec: ModuleShardingSpec) -> None:
    """Refuse a spec whose output order is the key order of a map: an artifact sorts keys."""
    order = spec.output_names() or (list(spec.out_dst) if isinstance(spec.out_dst, dict) else [])
    if not spec.out_names and len(order) > 1 and order != sorted(order):
        raise FreezeError(
            f"modules[{fqn!r}]: its outputs {order} are ordered only by the key order of out_src, "
            "which an artifact does not keep (canonical JSON sorts keys). Declare the order: add "
            f"out_names: {order} to the override for {fqn!r}."
        )


def _rule(fqn: str, spec: ModuleShardingSpec, group: str) -> dict[str, Any]:
    rule: dict[str, Any] = {}
    for row in fields_in_group(group):
        value = getattr(spec, row.name)
        if row.should_write(value):
            path = f"modules[{fqn!r}].{row.name}"
            rule[str(row.key)] = FREEZERS[str(row.freeze)](value, path)
    return rule


def freeze(plan: ShardingPlan) -> dict[str, Any]:
    """The plan as a JSON-safe meta; :func:`hp_core.artifact.rebuild` is its inverse.

    Deterministic: the same plan always gives an equal meta (and, through
    :func:`hp_core.artifact.canonical_json`, the same bytes).
    """
    if not isinstance(plan, ShardingPlan):
        raise FreezeError(f"freeze: expected a ShardingPlan, got {type(plan).__name__}.")
    mesh: dict[str, Any] = {"axis_names": list(plan.mesh_axis_names)}
    if plan.mesh_shape is not None:
        mesh["shape"] = list(plan.mesh_shape)
    meta: dict[str, Any] = {
        "mesh": mesh,
        "sequence_parallel": plan.sequence_parallel,
        "loss_parallel": plan.loss_parallel,
        "ep_size": plan.ep_size,
    }
    groups: dict[str, list[dict[str, Any]]] = {g: [] for g in FROZEN_GROUPS}
    for fqn, spec in plan.items():
        _check_output_order(fqn, spec)
        for group in FROZEN_GROUPS:
            rule = _rule(fqn, spec, group)
            if rule or group == PARAM_PLAN:  # param_plan lists every module, in model order
                groups[group].append({MATCH_KEY: fqn, **rule})
    meta.update(groups)
    providers = record_providers(plan)
    if providers:  # where the plan was made; not part of the plan's fingerprint
        meta[PROVIDERS_KEY] = providers_data(providers)
    return meta
