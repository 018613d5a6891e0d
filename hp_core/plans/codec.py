"""A plan <-> its plain document (the dict that :func:`hp_core.plans.dump_plan` writes as YAML)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hp_core.plans.errors import PlanTypeError, PlanYAMLError
from hp_core.plans.example import ExampleCall
from hp_core.plans.model import ShardingPlan, check_axis_names, check_shape
from hp_core.plans.providers import (
    PROVIDERS_KEY,
    providers_data,
    providers_from_data,
    record_providers,
)
from hp_core.plans.spec_codec import (
    PLAN_FORMAT_VERSION,
    USER_FIELDS,
    apply_internals,
    build_spec,
    check_keys,
    is_int,
    parse_bool,
    plan_data,
    tname,
)
from hp_core.spec.module_spec import ModuleShardingSpec

__all__ = ["plan_from_dict", "plan_to_dict"]

#: The training call the planner was given (optional).
EXAMPLE_KEY = "example"
_TOP_EXAMPLE = "version: 1\nmesh: {axis_names: [tp], shape: [4]}\nmodules: {...}"


def plan_to_dict(plan: ShardingPlan) -> dict[str, Any]:
    """The plan as plain data (the document :func:`dump_plan` writes as YAML).

    Placements become DSL strings, internals go under ``_internal``, injected callables
    become ``{_target_: module.qualname}`` (loading those back needs the package trusted).
    The providers of the registry items it names go under ``providers`` (from the registry
    now, see :mod:`hp_core.plans.providers`), when there are any; the training call the
    planner was given under ``example`` (:mod:`hp_core.plans.example`).
    """
    if not isinstance(plan, ShardingPlan):
        raise PlanTypeError(
            f"plan_to_dict: expected a ShardingPlan, got {tname(plan)}. Pass the plan that "
            "hp_core.plan(...) or load_plan returned."
        )
    data = plan_data(plan, strict=True)
    providers = record_providers(plan)
    if providers:
        data[PROVIDERS_KEY] = providers_data(providers)
    if plan.example is not None:
        data[EXAMPLE_KEY] = plan.example.to_data()
    return data


_PLAN_KEYS = (
    "version",
    "mesh",
    "sequence_parallel",
    "loss_parallel",
    "ep_size",
    "modules",
    PROVIDERS_KEY,
    EXAMPLE_KEY,
)
_MESH_KEYS = ("axis_names", "shape")
_MODULE_KEYS = (*USER_FIELDS, "_internal")


def plan_from_dict(data: Any) -> ShardingPlan:
    """A plan from the document form (inverse of :func:`plan_to_dict`), every value validated."""
    err = PlanYAMLError
    if not isinstance(data, Mapping):
        raise err(
            f"plan: expected a mapping with keys {', '.join(_PLAN_KEYS)}, got {tname(data)}. "
            f"Example:\n{_TOP_EXAMPLE}"
        )
    check_keys(data, "plan", err, _PLAN_KEYS)
    for key in ("version", "mesh", "modules"):
        if key not in data:
            raise err(
                f"{key}: missing required top-level key. A plan document looks like:\n"
                f"{_TOP_EXAMPLE}"
            )
    if data["version"] != PLAN_FORMAT_VERSION or not is_int(data["version"]):
        raise err(
            f"version: unsupported plan format version {data['version']!r}; this hp reads version "
            f"{PLAN_FORMAT_VERSION}. Re-create the plan with this hp (hp plan ... / dump_plan)."
        )
    mesh = data["mesh"]
    if not isinstance(mesh, Mapping):
        raise err(
            f"mesh: expected {{axis_names: [...], shape: [...]}}, got {tname(mesh)} {mesh!r}."
        )
    check_keys(mesh, "mesh", err, _MESH_KEYS)
    if "axis_names" not in mesh:
        raise err(
            "mesh.axis_names: missing; list the mesh axes in mesh order, e.g. axis_names: [tp, cp]."
        )
    names = check_axis_names(mesh["axis_names"], "mesh.axis_names", err)
    shape = check_shape(mesh.get("shape"), names, "mesh.shape", err)
    flags = {
        k: parse_bool(data.get(k, False), k, err, optional=False)
        for k in ("sequence_parallel", "loss_parallel")
    }
    ep_size = data.get("ep_size", 1)
    if not is_int(ep_size) or ep_size < 1:
        raise err(f"ep_size: expected a positive integer, got {ep_size!r}.")
    raw_modules = data["modules"]
    if not isinstance(raw_modules, Mapping):
        raise err(
            f"modules: expected a mapping of module FQN to its spec, got {tname(raw_modules)} "
            f"{raw_modules!r}."
        )
    modules: dict[str, ModuleShardingSpec] = {}
    for fqn, raw in raw_modules.items():
        if not isinstance(fqn, str):
            raise err(f"modules: keys must be module FQN strings, got {tname(fqn)} {fqn!r}.")
        path = f"modules[{fqn!r}]"
        if not isinstance(raw, Mapping):
            raise err(
                f"{path}: expected a mapping of spec fields (or {{}}), got {tname(raw)} {raw!r}."
            )
        check_keys(
            raw,
            path,
            err,
            _MODULE_KEYS,
            internal_hint="internal fields go under the module's '_internal:' mapping, without the "
            "underscore.",
        )
        spec = build_spec(raw, path, err, USER_FIELDS)
        if "_internal" in raw:
            apply_internals(spec, raw["_internal"], f"{path}._internal")
        modules[fqn] = spec
    return ShardingPlan(
        modules=modules,
        mesh_axis_names=names,
        mesh_shape=shape,
        sequence_parallel=bool(flags["sequence_parallel"]),
        loss_parallel=bool(flags["loss_parallel"]),
        ep_size=ep_size,
        providers=providers_from_data(data[PROVIDERS_KEY], err) if PROVIDERS_KEY in data else {},
        example=ExampleCall.from_data(data[EXAMPLE_KEY], EXAMPLE_KEY, err)
        if EXAMPLE_KEY in data
        else None,
    )
