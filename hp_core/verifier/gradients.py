"""Which gradients are partial sums, per parameter and axis — what ``apply`` then sums.

Inside a dispatching region the answer is DTensor's (the placement of the parameter's
gradient after the region's own backward); where code runs on local tensors it is the
contract's (``hp_core.runtime.partial``); outside every boundary it follows how the plan
lays activations out there. One answer per parameter object: tied names must agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import Partial, Replicate

from hp_core.plans.model import ShardingPlan
from hp_core.plans.proposal import propose, yaml_proposal
from hp_core.runtime.grads import GradReduction
from hp_core.runtime.partial import (
    AmbiguousGradientError,
    activations_on,
    contract_partial_axes,
    is_data_axis,
    is_expert_param,
)
from hp_core.spec.module_spec import layout_map
from hp_core.verifier.errors import MixedGradientError
from hp_core.verifier.passes import map_to_rep, prefixes
from hp_core.verifier.probes import BoundaryRecord

__all__ = ["derive", "enclosing_boundary"]


def _partial_axes(named: tuple[tuple[str, Any], ...], names: list[str]) -> tuple[str, ...]:
    by_axis = dict(named)
    return tuple(a for a in names if isinstance(by_axis.get(a), Partial) and not is_data_axis(a))


def enclosing_boundary(plan: ShardingPlan, fqn: str) -> str | None:
    """The innermost boundary strictly enclosing ``fqn`` (the root module counts)."""
    for p in reversed(["", *prefixes(fqn)[:-1]]):
        spec = plan.modules.get(p)
        if spec is not None and spec.is_boundary:
            return p
    return None


def _outside(
    plan: ShardingPlan, fqn: str, name: str, named: Mapping[str, Any], names: list[str]
) -> tuple[str, ...]:
    """Partial axes of a parameter whose module runs outside every boundary."""
    axes = []
    for axis in names:
        if is_data_axis(axis) or not isinstance(named.get(axis, Replicate()), Replicate):
            continue
        how = activations_on(plan.modules, axis)
        if how == "mixed":
            error = AmbiguousGradientError(
                f"{name}: its module runs outside every boundary, where activations are split on "
                f"{axis!r} in some places and whole in others, so hp cannot tell which tokens it "
                f"sees.\nFix: make {fqn or 'it'} a boundary that declares its input whole."
            )
            entry = (
                f"  - match: {fqn!r}\n    in_src: {{input: {{{axis}: replicate}}}}\n"
                f"    out_src: {{output: {{{axis}: replicate}}}}\n"
                f"    out_dst: {{output: {{{axis}: replicate}}}}\n"
            )
            raise propose(error, yaml_proposal(entry, f"making {fqn} a boundary with whole input"))
        if how == "sharded":
            axes.append(axis)
    return tuple(axes)


def _region_layouts(plan: ShardingPlan) -> dict[str, dict[str, Mapping[str, Any]]]:
    """Per boundary: every parameter layout its region computes with, by path relative to it."""
    out: dict[str, dict[str, Mapping[str, Any]]] = {}
    for f, s in plan.items():
        covered = f if s.is_boundary else enclosing_boundary(plan, f)
        if covered is None:
            continue
        for rel, named in layout_map(s.params).items():
            full = f"{f}.{rel}" if f else rel
            out.setdefault(covered, {})[full[len(covered) + 1 :] if covered else full] = named
    return out


def derive(
    model: nn.Module,
    plan: ShardingPlan,
    names: list[str],
    records: Mapping[str, BoundaryRecord],
    repeats: Mapping[str, str],
) -> tuple[tuple[GradReduction, ...], dict[str, str]]:
    """Every parameter's partial axes: propagation where it ran, the contract elsewhere.

    Names are the plan's; a repeated layer takes the answer of the layer checked in its place.
    """
    opaque: dict[str, str] = {}
    found: dict[str, list[tuple[tuple[str, ...], str]]] = {}  # parameter FQN → [(axes, source)]
    layouts = _region_layouts(plan)
    for fqn, spec in plan.items():
        covered = fqn if spec.is_boundary else enclosing_boundary(plan, fqn)
        for rel, named in layout_map(spec.params).items():
            if is_expert_param(spec, named):
                continue  # experts: their replicas are summed by the expert layout
            name = f"{fqn}.{rel}" if fqn else rel
            if covered is None:
                found.setdefault(name, []).append(
                    (_outside(plan, fqn, name, named, names), "contract")
                )
                continue
            rec = records.get(map_to_rep(covered, repeats))
            grads = None if rec is None else rec.grads.get(map_to_rep(name, repeats))
            deferred = spec.is_boundary and rel in spec._deferred_bias_params
            if rec is not None and rec.dispatching and grads and not deferred:
                for placements in grads:
                    found.setdefault(name, []).append(
                        (_partial_axes(placements, names), "propagation")
                    )
                continue
            if rec is not None and not rec.dispatching:
                opaque.setdefault(
                    covered,
                    rec.skipped
                    or "its compute runs on local tensors (region_dispatch=False or injected)",
                )
            region = plan[covered]
            rel_in_region = name[len(covered) + 1 :] if covered else name
            if (
                fqn != covered
            ):  # a non-boundary spec inside the region: judge it by the region's contract
                region = dataclasses.replace(
                    region, params={**layout_map(region.params), rel_in_region: named}
                )
                region._deferred_bias_params = plan[covered]._deferred_bias_params
            axes = contract_partial_axes(
                covered, region, rel_in_region, names, region_params=layouts.get(covered, {})
            )
            found.setdefault(name, []).append((axes, "contract"))
    return _per_parameter(model, found), opaque


def _per_parameter(
    model: nn.Module, found: Mapping[str, list[tuple[tuple[str, ...], str]]]
) -> tuple[GradReduction, ...]:
    """One reduction per parameter object; tied names (and every use) must agree."""
    by_object: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_object.setdefault(id(p), []).append(n)
    reductions: list[GradReduction] = []
    for aliases in by_object.values():
        uses = [c for n in aliases for c in found.get(n, ())]
        kinds = {axes for axes, _ in uses}
        if len(kinds) > 1:
            most, least = max(kinds, key=len), min(kinds, key=len)
            raise MixedGradientError(
                f"{aliases[0]}: its gradient is partial over {list(most)} in one use and over "
                f"{list(least) or 'nothing'} in another (names {aliases}); no single reduction "
                "makes both right. Give its uses the same layout, or untie the weights."
            )
        if kinds and (axes := next(iter(kinds))):
            source = "propagation" if any(s == "propagation" for _, s in uses) else "contract"
            reductions.append(GradReduction(aliases[0], axes, source))
    return tuple(reductions)
