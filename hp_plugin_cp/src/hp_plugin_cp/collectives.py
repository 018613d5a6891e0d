"""The differentiable K/V all-gather over the cp group, and the small reductions CP needs.

K and V travel together: they are packed into one tensor along the feature dim, so each
attention call costs exactly one ``all_gather_single`` forward and one
``reduce_scatter_single`` backward (every rank's queries contribute to every rank's keys,
so the gradient of a gathered key is the sum over ranks — a reduce-scatter).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_kv", "all_gather_sequence", "all_reduce_sum"]


class _AllGatherSeq(torch.autograd.Function):
    """Gather along ``dim`` in rank order; backward: reduce-scatter (sum) along ``dim``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        n = dist.get_world_size(group)
        front = x.movedim(dim, 0).contiguous()
        out = front.new_empty((n * front.shape[0], *front.shape[1:]))
        dist.all_gather_single(out, front, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        n = dist.get_world_size(ctx.group)
        front = grad.movedim(ctx.dim, 0).contiguous()
        out = front.new_empty((front.shape[0] // n, *front.shape[1:]))
        dist.reduce_scatter_single(out, front, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


class _AllReduceSum(torch.autograd.Function):
    """Forward: sum over the group. Backward: identity (each rank owns its own share)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None


def all_gather_sequence(x: torch.Tensor, group: Any, *, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); backward reduce-scatters."""
    return _AllGatherSeq.apply(x, dim % x.dim(), group)


def all_gather_kv(key: torch.Tensor, value: torch.Tensor, group: Any, *, seq_dim: int = -2) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather K and V along the sequence dim in **one** collective (packed along the last dim).

    ``key`` ``[..., L, Dk]`` and ``value`` ``[..., L, Dv]`` must agree on every dim but the
    last. Returns ``[..., cp * L, Dk]`` and ``[..., cp * L, Dv]`` in rank order.
    """
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(
            f"all_gather_kv: key {tuple(key.shape)} and value {tuple(value.shape)} must agree on every "
            "dim but the last (batch, heads, sequence) to travel in one packed collective."
        )
    packed = torch.cat([key, value], dim=-1)
    gathered = all_gather_sequence(packed, group, dim=seq_dim % packed.dim())
    k, v = gathered.split([key.shape[-1], value.shape[-1]], dim=-1)
    return k, v


def all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Differentiable sum over ``group`` whose backward is the identity (a loss's shares)."""
    return _AllReduceSum.apply(x, group)
