"""Differentiable single-axis collectives on local tensors (production mode's hot path).

Each transition of SPEC §5 that changes one mesh axis is one autograd function whose
backward is the adjoint collective (see ``hp_core.planner.comms`` for the table). No
DTensor is involved: these are plain ``torch.distributed`` calls on the axis's group.

Meta tensors carry no values, so on them every collective only computes its output
shape (the verifier runs production's code this way, before any real collective).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_along",
    "all_reduce",
    "reduce_scatter_along",
    "slice_along",
]


def _world(group: Any) -> int:
    return dist.get_world_size(group)


def _gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
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


def _scatter_sum(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
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


def _sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    if _world(group) == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)
    if not x.is_meta:
        dist.all_reduce(x, group=group)
    return x


def _chunk(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    n = _world(group)
    if n == 1:
        return x
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, grad_partial: bool) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.grad_partial = dim, group, grad_partial
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        if ctx.grad_partial:
            return _scatter_sum(g, ctx.dim, ctx.group), None, None, None
        return _chunk(g, ctx.dim, ctx.group), None, None, None


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _chunk(x, dim, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _gather(g, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _scatter_sum(x, dim, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _gather(g, ctx.dim, ctx.group), None, None


class _AllReduce(torch.autograd.Function):
    """Forward: sum partials; backward: identity (each rank holds the whole gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _sum(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return g, None


class _CopyToRegion(torch.autograd.Function):
    """Forward: identity; backward: sum the partial gradients of a replicated input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _sum(g, ctx.group), None


def all_gather_along(x: torch.Tensor, dim: int, group: Any, *, grad_partial: bool) -> torch.Tensor:
    """shard(dim) → replicate. Backward: reduce-scatter if the gradient is partial, else slice."""
    return _AllGather.apply(x, dim, group, grad_partial)


def slice_along(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """replicate → shard(dim): keep this rank's chunk. Backward: all-gather."""
    return _Slice.apply(x, dim, group)


def reduce_scatter_along(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """partial → shard(dim). Backward: all-gather."""
    return _ReduceScatter.apply(x, dim, group)


def all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """partial → replicate. Backward: identity."""
    return _AllReduce.apply(x, group)


def copy_to_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """replicate → replicate with a partial gradient: identity forward, all-reduce backward."""
    return _CopyToRegion.apply(x, group)
