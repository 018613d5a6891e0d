"""The collectives of hp: one transition table, and the autograd collectives it names.

A layout change ``src → dst`` on one mesh axis costs one collective forward and its
adjoint backward. :data:`TRANSITIONS` is the one table of those rules: the planner's
prediction (``hp plan``, ``explain()``), the runtime's lowering of production mode's
transitions, the verifier and the tests all read it, so what hp predicts is what it runs.

| src → dst | forward | backward (grad in dst's layout) | runs |
|---|---|---|---|
| shard(d) → replicate | all_gather | reduce_scatter if partial, else slice | all_gather_along |
| replicate → shard(d) | none (slice) | all_gather | slice_along |
| partial → replicate | all_reduce | none | all_reduce |
| partial → shard(d) | reduce_scatter | all_gather | reduce_scatter_along |
| replicate → replicate | none | all_reduce if partial, else none | copy_to_region |
| shard(a) → shard(b) | all_to_all | all_to_all | DTensor's redistribute |
| replicate → partial | none (a local rescale) | none | DTensor's redistribute |

The gradient of an input that a boundary gathers to ``replicate`` is partial when the
boundary shards parameters on that axis (:func:`grad_is_partial`: every rank contributes
its slice of the weight's contraction); otherwise each rank computes the whole gradient.

The autograd collectives are plain ``torch.distributed`` calls on one axis's process
group (no DTensor), each with the adjoint collective as its backward. Plugins use them
(:func:`all_gather_along` for CP's K/V gather, :func:`all_to_all` for EP's uneven token
dispatch), so every collective hp issues is one of these. Meta tensors carry no values:
on them a collective only computes its output shape (the verifier runs production's code
this way, before any real collective).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

if TYPE_CHECKING:  # a type only: this module stays a leaf of torch alone
    from torch.distributed import ProcessGroup

    from hp_core.spec.module_spec import ModuleShardingSpec

__all__ = [
    "TRANSITIONS",
    "Collective",
    "Lowering",
    "Rule",
    "Transition",
    "all_gather_along",
    "all_reduce",
    "all_to_all",
    "copy_to_region",
    "grad_is_partial",
    "reduce_scatter_along",
    "rule",
    "slice_along",
    "transition",
]

#: The collective names hp uses (what ``hp_core.testing.probe.CollectiveCounter`` reports).
CollectiveOp = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective on one mesh axis, in the forward or the backward pass.

    Boundaries' transitions are predicted as these, and a registry item (inner wrapper,
    compute factory) declares the collectives it issues per call as a list of these.
    """

    op: str
    axis: str
    phase: str  # "forward" | "backward"
    where: str  # "<fqn> in_src.hidden_states" etc.


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


# ----------------------------------------------------------------- the collectives


def _world(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def _gather(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    n = _world(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    if not x.is_meta:
        dist.all_gather_single(out, x, group=group)
    if dim == 0:
        return out
    return torch.cat(out.chunk(n, dim=0), dim=dim)


def _scatter_sum(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    n = _world(group)
    if n == 1:
        return x
    src = x.contiguous() if dim == 0 else torch.cat(x.chunk(n, dim=dim), dim=0).contiguous()
    shape = list(src.shape)
    shape[0] //= n
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if not x.is_meta:
        dist.reduce_scatter_single(out, src, group=group)
    return out


def _sum(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    if _world(group) == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)
    if not x.is_meta:
        dist.all_reduce(x, group=group)
    return x


def _chunk(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    n = _world(group)
    if n == 1:
        return x
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def _exchange(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    if not x.is_meta:
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup, grad_partial: bool
    ) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.grad_partial = dim, group, grad_partial
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        if ctx.grad_partial:
            return _scatter_sum(g, ctx.dim, ctx.group), None, None, None
        return _chunk(g, ctx.dim, ctx.group), None, None, None


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _chunk(x, dim, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _gather(g, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _scatter_sum(x, dim, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _gather(g, ctx.dim, ctx.group), None, None


class _AllReduce(torch.autograd.Function):
    """Forward: sum partials; backward: identity (each rank holds the whole gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _sum(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return g, None


class _CopyToRegion(torch.autograd.Function):
    """Forward: identity; backward: sum the partial gradients of a replicated input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _sum(g, ctx.group), None


class _AllToAll(torch.autograd.Function):
    """Uneven ``all_to_all_single`` whose backward is the reverse all-to-all."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def all_gather_along(
    x: torch.Tensor, dim: int, group: ProcessGroup, *, grad_partial: bool
) -> torch.Tensor:
    """shard(dim) → replicate: every rank's ``x`` concatenated along ``dim`` in rank order.

    Backward: reduce-scatter (sum) if the gradient is partial (every rank's computation
    touches every rank's rows, as CP's gathered keys and values), else a local slice.
    """
    return _AllGather.apply(x, dim % x.dim(), group, grad_partial)


def slice_along(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """replicate → shard(dim): keep this rank's chunk. Backward: all-gather."""
    return _Slice.apply(x, dim, group)


def reduce_scatter_along(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """partial → shard(dim). Backward: all-gather."""
    return _ReduceScatter.apply(x, dim, group)


def all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """partial → replicate: the sum over ``group``. Backward: identity (a loss's shares)."""
    return _AllReduce.apply(x, group)


def copy_to_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """replicate → replicate with a partial gradient: identity forward, all-reduce backward."""
    return _CopyToRegion.apply(x, group)


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``x`` with uneven splits.

    ``in_splits[r]`` rows go to rank ``r``, ``out_splits[r]`` rows arrive from it (in rank
    order). Backward: the reverse all-to-all.
    """
    return _AllToAll.apply(x, out_splits, in_splits, group)


# ----------------------------------------------------------------- the table

#: ``lower(x, dim, group)``: the autograd collective that runs a row on one axis's group
#: (``dim``: the sharded tensor dim of src or dst, None for neither).
Lowering = Callable[[torch.Tensor, Any, Any], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of :data:`TRANSITIONS`: the collective of each pass, and what runs it.

    ``lower`` is None where production has no single-collective lowering and goes
    through DTensor's ``redistribute`` (or where nothing needs to run).
    """

    forward: str | None
    backward: str | None
    lower: Lowering | None


_NONE = Rule(None, None, None)

#: (src kind, dst kind, gradient partial) → :class:`Rule`; kinds are ``shard``,
#: ``replicate`` and ``partial``. The gradient is partial only where dst is replicate.
TRANSITIONS: Mapping[tuple[str, str, bool], Rule] = {
    ("shard", "replicate", True): Rule(
        "all_gather", "reduce_scatter", lambda x, d, g: all_gather_along(x, d, g, grad_partial=True)
    ),
    ("shard", "replicate", False): Rule(
        "all_gather", None, lambda x, d, g: all_gather_along(x, d, g, grad_partial=False)
    ),
    ("replicate", "shard", False): Rule(None, "all_gather", slice_along),
    ("partial", "replicate", True): Rule("all_reduce", None, lambda x, d, g: all_reduce(x, g)),
    ("partial", "replicate", False): Rule("all_reduce", None, lambda x, d, g: all_reduce(x, g)),
    ("partial", "shard", False): Rule("reduce_scatter", "all_gather", reduce_scatter_along),
    ("replicate", "replicate", True): Rule(
        None, "all_reduce", lambda x, d, g: copy_to_region(x, g)
    ),
    ("replicate", "replicate", False): _NONE,
    ("shard", "shard", False): Rule("all_to_all", "all_to_all", None),
    ("replicate", "partial", False): _NONE,  # a local rescale, no communication
}


def _kind(p: Placement) -> str | None:
    if isinstance(p, Shard):
        return "shard"
    if isinstance(p, Replicate):
        return "replicate"
    if isinstance(p, Partial):
        return "partial"
    return None


def rule(src: Placement, dst: Placement, *, grad_partial: bool) -> Rule:
    """The row of :data:`TRANSITIONS` for ``src → dst`` on one axis.

    An unchanged shard or partial moves nothing; ``grad_partial`` counts only where dst
    is replicate (elsewhere the gradient arrives in dst's own layout). A pair the table
    has no row for (e.g. shard → partial) has no collective and no lowering.
    """
    if src == dst and not isinstance(src, Replicate):
        return _NONE
    key = (_kind(src), _kind(dst), bool(grad_partial) and isinstance(dst, Replicate))
    return TRANSITIONS.get(key, _NONE)  # type: ignore[arg-type]


def transition(
    src: Placement, dst: Placement, *, grad_partial: bool
) -> tuple[str | None, str | None]:
    """(forward op, backward op) for one axis; None means no communication."""
    r = rule(src, dst, grad_partial=grad_partial)
    return r.forward, r.backward


def grad_is_partial(spec: ModuleShardingSpec, axis: str) -> bool:
    """Whether the gradient of an input gathered on ``axis`` comes back partial."""
    params = spec.params if isinstance(spec.params, dict) else {}
    return any(isinstance(named.get(axis), Shard) for named in params.values())
