"""Which collectives a plan implies: per boundary transition, forward and backward.

One rule table serves the planner's predictions (``hp plan``, ``explain()``) and the
tests that count real collectives. A transition ``src → dst`` on one mesh axis:

| src → dst | forward | backward (grad arrives in dst's layout) |
|---|---|---|
| shard(d) → replicate | all_gather | reduce_scatter if the grad is partial, else none (slice) |
| replicate → shard(d) | none (slice) | all_gather |
| partial → replicate | all_reduce | none |
| partial → shard(d) | reduce_scatter | all_gather |
| replicate → replicate | none | all_reduce if the grad is partial, else none |
| shard(a) → shard(b) | all_to_all | all_to_all |

The gradient of an input that a boundary gathers to ``replicate`` is partial when the
boundary shards parameters on that axis (every rank contributes its slice of the
weight's contraction); otherwise each rank computes the whole gradient itself.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from hp_core.mesh import is_data_axis
from hp_core.spec.module_spec import ModuleShardingSpec

__all__ = [
    "Collective",
    "Transition",
    "boundary_collectives",
    "boundary_transitions",
    "grad_is_partial",
    "input_check_axes",
    "reduction_axes",
    "sp_grad_params",
    "step_collectives",
    "transition",
]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective on one mesh axis, in the forward or the backward pass."""

    op: str
    axis: str
    phase: str  # "forward" | "backward"
    where: str  # "<fqn> in_src.hidden_states" etc.


def transition(src: Placement, dst: Placement, *, grad_partial: bool) -> tuple[str | None, str | None]:
    """(forward op, backward op) for one axis; None means no communication."""
    if src == dst:
        if isinstance(src, Replicate) and grad_partial:
            return None, "all_reduce"
        return None, None
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return "all_gather", ("reduce_scatter" if grad_partial else None)
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return None, "all_gather"
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        return "all_reduce", None
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return "reduce_scatter", "all_gather"
    if isinstance(src, Shard) and isinstance(dst, Shard):
        return "all_to_all", "all_to_all"
    return None, None  # replicate → partial: a local rescale, no communication


def grad_is_partial(spec: ModuleShardingSpec, axis: str) -> bool:
    """Whether the gradient of an input gathered on ``axis`` comes back partial."""
    params = spec.params if isinstance(spec.params, dict) else {}
    return any(isinstance(named.get(axis), Shard) for named in params.values())


@dataclasses.dataclass(frozen=True)
class Transition:
    """One entry or exit layout change of one boundary on one mesh axis.

    ``forward`` / ``backward`` name the collective of each pass (None: no communication).
    """

    fqn: str
    side: str  # "in" | "out"
    name: str  # input or output name
    axis: str
    src: Placement
    dst: Placement
    forward: str | None
    backward: str | None


def _pairs(src: Mapping[str, Mapping[str, Placement]] | None, dst: Mapping[str, Mapping[str, Placement]] | None):
    src = src if isinstance(src, dict) else {}
    dst = dst if isinstance(dst, dict) else {}
    for name in src:
        if name in dst:
            axes = list(dict.fromkeys([*src[name], *dst[name]]))
            for axis in axes:
                yield name, axis, src[name].get(axis, Replicate()), dst[name].get(axis, Replicate())


def boundary_transitions(fqn: str, spec: ModuleShardingSpec) -> list[Transition]:
    """Every entry (``in_src → in_dst``) and exit (``out_src → out_dst``) transition, per axis.

    Unchanged layouts are listed too (their forward is None; a replicated input of a
    boundary that shards parameters still all-reduces its gradient). A non-boundary
    (``is_boundary=False``) has none.
    """
    out: list[Transition] = []
    if not spec.is_boundary:
        return out
    for name, axis, s, d in _pairs(spec.in_src, spec.in_dst):
        fwd, bwd = transition(s, d, grad_partial=grad_is_partial(spec, axis))
        out.append(Transition(fqn, "in", name, axis, s, d, fwd, bwd))
    for name, axis, s, d in _pairs(spec.out_src, spec.out_dst):
        fwd, bwd = transition(s, d, grad_partial=False)
        out.append(Transition(fqn, "out", name, axis, s, d, fwd, bwd))
    return out


def boundary_collectives(fqn: str, spec: ModuleShardingSpec) -> list[Collective]:
    """The collectives of one boundary's entry and exit transitions."""
    out: list[Collective] = []
    for t in boundary_transitions(fqn, spec):
        if t.forward:
            out.append(Collective(t.forward, t.axis, "forward", f"{fqn} {t.side}.{t.name}"))
        if t.backward:
            out.append(Collective(t.backward, t.axis, "backward", f"{fqn} {t.side}.{t.name}"))
    return out


def sp_grad_params(modules: Mapping[str, ModuleShardingSpec]) -> list[str]:
    """Parameters replicated on tp inside boundaries that compute on tp-sequence-sharded inputs.

    Each rank sees only its tokens, so their gradients are partial sums; hp reduces them
    once per step, all together. Deferred rowwise biases count too when their boundary
    exits tp-sharded: they are added after the reduce-scatter, to this rank's tokens only
    (Megatron marks them ``sequence_parallel`` for the same reason).
    """
    out = []
    for fqn, spec in modules.items():
        if not spec.is_boundary or not isinstance(spec.params, dict) or not spec.params:
            continue
        in_dst = spec.in_dst if isinstance(spec.in_dst, dict) else {}
        out_dst = spec.out_dst if isinstance(spec.out_dst, dict) else {}
        sharded_in = any(isinstance(layout.get("tp"), Shard) for layout in in_dst.values())
        sharded_out = any(isinstance(layout.get("tp"), Shard) for layout in out_dst.values())
        deferred = set(spec._deferred_bias_params) if sharded_out else set()
        if not sharded_in and not deferred:
            continue
        for rel, named in spec.params.items():
            if not isinstance(named.get("tp", Replicate()), Replicate) or "ep" in named:
                continue
            if sharded_in or rel in deferred:
                out.append(f"{fqn}.{rel}" if fqn else rel)
    return out


def reduction_axes(modules: Mapping[str, ModuleShardingSpec], reductions: Iterable[Any] | None = None) -> list[str]:
    """The axes over which hp sums partial gradients once per step.

    With ``reductions`` (a verifier report's, ``VerifyReport.reductions``) this is exact.
    Without, it is the contract's prediction: an axis along which some boundary's data is
    sharded while one of its parameters is replicated (which misses gradients that are
    partial only because of what happens inside a region — the verifier finds those).
    """
    if reductions is not None:
        return list(dict.fromkeys(a for r in reductions for a in r.axes))
    axes: list[str] = ["tp"] if sp_grad_params(modules) else []
    for spec in modules.values():
        if not spec.is_boundary or not isinstance(spec.params, dict) or not spec.params:
            continue
        in_dst = spec.in_dst if isinstance(spec.in_dst, dict) else {}
        for layout in in_dst.values():
            for axis, p in layout.items():
                replicated = any(isinstance(named.get(axis, Replicate()), Replicate) and "ep" not in named for named in spec.params.values())
                if isinstance(p, Shard) and replicated and axis not in axes and not is_data_axis(axis):
                    axes.append(str(axis))
    return axes


def input_check_axes(axis_names: Iterable[str], sizes: Iterable[int]) -> list[str]:
    """The axes the input guard compares a forward's inputs over (non-dp axes of size > 1)."""
    return [str(a) for a, n in zip(axis_names, sizes, strict=True) if int(n) > 1 and not is_data_axis(a)]


def step_collectives(
    modules: Mapping[str, ModuleShardingSpec],
    *,
    loss_parallel: bool = False,
    reductions: Iterable[Any] | None = None,
    check_axes: Iterable[str] = (),
) -> Counter[tuple[str, str, str]]:
    """``{(phase, op, axis): count}`` for one forward + backward of the whole plan.

    ``loss_parallel`` adds the vocab-parallel cross-entropy's two forward all-reduces
    (the max, then the sum of exponentials packed with the target logit). The gradient
    reductions count one all-reduce per axis (:func:`reduction_axes`); the input guard one
    small forward all-reduce per axis of ``check_axes`` (:func:`input_check_axes`).
    """
    counts: Counter[tuple[str, str, str]] = Counter()
    for axis in check_axes:
        counts[("forward", "all_reduce", axis)] += 1
    if loss_parallel:
        counts[("forward", "all_reduce", "tp")] += 2
    for fqn, spec in modules.items():
        for c in boundary_collectives(fqn, spec):
            counts[(c.phase, c.op, c.axis)] += 1
    for axis in reduction_axes(modules, reductions):
        counts[("backward", "all_reduce", axis)] += 1  # one bucketed reduction per step
    return counts
