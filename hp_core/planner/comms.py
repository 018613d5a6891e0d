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
from collections.abc import Mapping

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from hp_core.spec import ModuleShardingSpec

__all__ = ["Collective", "boundary_collectives", "grad_is_partial", "step_collectives", "transition"]


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


def _pairs(src: Mapping[str, Mapping[str, Placement]] | None, dst: Mapping[str, Mapping[str, Placement]] | None):
    src = src if isinstance(src, dict) else {}
    dst = dst if isinstance(dst, dict) else {}
    for name in src:
        if name in dst:
            axes = list(dict.fromkeys([*src[name], *dst[name]]))
            for axis in axes:
                yield name, axis, src[name].get(axis, Replicate()), dst[name].get(axis, Replicate())


def boundary_collectives(fqn: str, spec: ModuleShardingSpec) -> list[Collective]:
    """The collectives of one boundary's entry and exit transitions."""
    out: list[Collective] = []
    if not spec.is_boundary:
        return out
    for name, axis, s, d in _pairs(spec.in_src, spec.in_dst):
        fwd, bwd = transition(s, d, grad_partial=grad_is_partial(spec, axis))
        if fwd:
            out.append(Collective(fwd, axis, "forward", f"{fqn} in.{name}"))
        if bwd:
            out.append(Collective(bwd, axis, "backward", f"{fqn} in.{name}"))
    for name, axis, s, d in _pairs(spec.out_src, spec.out_dst):
        fwd, bwd = transition(s, d, grad_partial=False)
        if fwd:
            out.append(Collective(fwd, axis, "forward", f"{fqn} out.{name}"))
        if bwd:
            out.append(Collective(bwd, axis, "backward", f"{fqn} out.{name}"))
    return out


def sp_grad_params(modules: Mapping[str, ModuleShardingSpec]) -> list[str]:
    """Parameters replicated on tp inside boundaries that compute on tp-sequence-sharded inputs.

    Each rank sees only its tokens, so their gradients are partial sums; hp reduces them
    once per step, all together.
    """
    out = []
    for fqn, spec in modules.items():
        if not spec.is_boundary or not isinstance(spec.params, dict) or not spec.params:
            continue
        in_dst = spec.in_dst if isinstance(spec.in_dst, dict) else {}
        if not any(isinstance(layout.get("tp"), Shard) for layout in in_dst.values()):
            continue
        for rel, named in spec.params.items():
            if isinstance(named.get("tp", Replicate()), Replicate) and "ep" not in named:
                out.append(f"{fqn}.{rel}" if fqn else rel)
    return out


def step_collectives(modules: Mapping[str, ModuleShardingSpec]) -> Counter[tuple[str, str, str]]:
    """``{(phase, op, axis): count}`` for one forward + backward of the whole plan."""
    counts: Counter[tuple[str, str, str]] = Counter()
    for fqn, spec in modules.items():
        for c in boundary_collectives(fqn, spec):
            counts[(c.phase, c.op, c.axis)] += 1
    if sp_grad_params(modules):
        counts[("backward", "all_reduce", "tp")] += 1  # one bucketed reduction per step
    return counts
