"""Which parameter gradients a region's contract makes partial, where propagation cannot look.

Inside a dispatching region DTensor propagation decides (the verifier asks it). Code that
runs on local tensors — a region with ``region_dispatch=False``, injected compute, a
rowwise bias added after the exit reduction — is opaque to DTensor, so there the answer
comes from the declared layouts alone:

* a parameter sharded on an axis has a sharded gradient: nothing to sum;
* a parameter replicated on an axis along which the region's data is sharded (an input
  ``in_dst`` layout says ``shard`` there) meets only this rank's part of the data, so its
  gradient is this rank's share of the sum: partial;
* a parameter replicated on an axis on which some *other* parameter of the region is
  sharded may meet sharded intermediate values (heads, features) that the layouts do not
  show: hp cannot tell, and refuses (:class:`AmbiguousGradientError`);
* otherwise every rank computes the same thing: the gradient is whole.

A deferred rowwise bias is added to the region's *output* after the exit transition, so
the data it meets is the ``out_dst`` layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch.distributed.tensor import Placement, Replicate, Shard

from hp_core.errors import HpError
from hp_core.mesh import is_data_axis
from hp_core.plans.fixes import keep_whole_proposals
from hp_core.plans.proposal import propose
from hp_core.spec.module_spec import ModuleShardingSpec, layout_map

__all__ = [
    "AmbiguousGradientError",
    "activations_on",
    "contract_partial_axes",
    "data_axes",
    "is_data_axis",
    "is_expert_param",
]


class AmbiguousGradientError(HpError, ValueError):
    """A replicated parameter of an opaque region whose gradient may or may not be partial."""


def _sharded_axes(layouts: Mapping[str, Mapping[str, Placement]] | None) -> set[str]:
    return {
        str(a)
        for named in (layouts or {}).values()
        for a, p in named.items()
        if isinstance(p, Shard)
    }


def is_expert_param(spec: ModuleShardingSpec, named: Mapping[str, Placement]) -> bool:
    """An expert parameter of an expert-parallel block: it lives on the derived expert mesh."""
    return spec._ep_size > 1 and "ep" in named


def data_axes(spec: ModuleShardingSpec) -> set[str]:
    """Axes along which the region's input data is sharded (its ``in_dst`` layouts)."""
    return _sharded_axes(spec.in_dst if isinstance(spec.in_dst, dict) else None)


def activations_on(modules: Mapping[str, ModuleShardingSpec], axis: str) -> str:
    """How activations between boundaries are laid out on ``axis``: 'sharded', 'whole' or 'mixed'.

    Read off every boundary's ``in_src`` and ``out_dst`` (what flows between them): under
    context parallelism the sequence is sharded everywhere; under sequence parallelism some
    activations are sharded and some (the embedding's output) whole.
    """
    seen: set[bool] = set()
    for spec in modules.values():
        if not spec.is_boundary:
            continue
        for field in (spec.in_src, spec.out_dst):
            for named in layout_map(field).values():
                if axis in named:
                    seen.add(isinstance(named[axis], Shard))
    if not seen or seen == {False}:
        return "whole"
    return "sharded" if seen == {True} else "mixed"


def contract_partial_axes(
    fqn: str,
    spec: ModuleShardingSpec,
    rel: str,
    axes: Iterable[str],
    *,
    region_params: Mapping[str, Mapping[str, Placement]] | None = None,
) -> tuple[str, ...]:
    """The axes of ``axes`` on which parameter ``rel`` of boundary ``fqn`` has a partial gradient.

    ``region_params`` are all parameters the region computes with (default: the spec's own).
    """
    params = spec.params if isinstance(spec.params, dict) else {}
    named = params.get(rel, {})
    others = region_params if region_params is not None else params
    deferred = rel in spec._deferred_bias_params
    data = (
        _sharded_axes(spec.out_dst if isinstance(spec.out_dst, dict) else None)
        if deferred
        else data_axes(spec)
    )
    out: list[str] = []
    for axis in axes:
        if is_data_axis(axis) or not isinstance(named.get(axis, Replicate()), Replicate):
            continue
        if not deferred and any(
            isinstance(o.get(axis), Shard) for r, o in others.items() if r != rel
        ):
            sharded = sorted(r for r, o in others.items() if isinstance(o.get(axis), Shard))
            error = AmbiguousGradientError(
                f"{fqn}.{rel}: kept whole on {axis!r} in a block whose code runs on local shards "
                f"(not through DTensor) next to {sharded[:3]}, which are split on {axis!r}: "
                "whether it meets split or whole values there cannot be read off the plan, so its "
                f"gradient's sum cannot be derived.\nFix: split it on {axis!r} like its "
                f"neighbours, or keep the whole block {fqn!r} whole on {axis!r}."
            )
            raise propose(error, *keep_whole_proposals(fqn, spec, axis))
        if axis in data:
            out.append(axis)
    return tuple(out)
