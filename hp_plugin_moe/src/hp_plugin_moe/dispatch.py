"""Token dispatch and combine over an expert group with all-to-all.

Per MoE call, on every rank of the expert group (``ep`` ranks, ``E / ep`` experts each,
expert ``e`` on rank ``e // (E / ep)``):

1. flatten the (token, k) pairs and sort them by expert (stable: token order within
   an expert), optionally dropping the pairs beyond an expert's capacity;
2. all-to-all of the per-expert pair counts (so every rank knows what it receives);
3. all-to-all of the token rows, with uneven splits (**dispatch**);
4. local experts on the received rows, grouped by local expert;
5. all-to-all of the results back to where the rows came from (**combine**);
6. weight each row by its router score and scatter-add it to its token.

Forward: 3 all-to-alls (counts, dispatch, combine). Backward: 2 (the adjoints of
dispatch and combine; counts carry no gradient). Every rank runs every step, even
with nothing to send or receive, so the collectives always match up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TokenDispatcher", "all_to_all"]


class _AllToAll(torch.autograd.Function):
    """Uneven ``all_to_all_single`` whose backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``x``: ``in_splits[r]`` rows go to rank ``r``,
    ``out_splits[r]`` rows arrive from it (in rank order)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


ExpertFn = Callable[[torch.Tensor, list[int]], torch.Tensor]


class TokenDispatcher:
    """Dispatch → local experts → combine for one MoE block (``group=None``: no expert parallelism).

    ``capacity_factor`` bounds what each rank sends to each expert per call to
    ``ceil(capacity_factor * T * K / E)`` (T local tokens, K experts per token, E
    experts); pairs beyond it are dropped in token order and contribute nothing.
    ``last_dropped`` / ``last_received`` describe the latest call.
    """

    def __init__(self, num_experts: int, group: Any, *, capacity_factor: float | None = None) -> None:
        self.num_experts = num_experts
        self.group = group
        self.ep = dist.get_world_size(group) if group is not None else 1
        self.num_local = num_experts // self.ep
        self.capacity_factor = capacity_factor
        self.last_dropped = 0
        self.last_received: list[int] = []

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, expert_fn: ExpertFn) -> torch.Tensor:
        """``x [T, H]``, router ``weights``/``experts`` ``[T, K]`` → the routed output ``[T, H]``.

        ``expert_fn(rows, counts)`` runs the local experts on ``rows`` grouped by local
        expert (``counts[j]`` rows for expert ``j``, zero allowed) and returns their outputs.
        """
        tokens, k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.last_dropped = 0
        if self.capacity_factor is not None:
            cap = math.ceil(self.capacity_factor * tokens * k / self.num_experts)
            start = torch.cumsum(counts, 0) - counts
            keep = torch.arange(order.numel(), device=order.device) - start[flat[order]] < cap
            self.last_dropped = int((~keep).sum())
            order, counts = order[keep], counts.clamp(max=cap)
        token_of = order // k
        send = x[token_of]
        if self.group is None:
            received = counts.view(1, self.num_local)
            rows = send
        else:
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.group)  # E/ep counts to each rank
            received = received.view(self.ep, self.num_local)
            in_splits = counts.view(self.ep, self.num_local).sum(1).tolist()
            out_splits = received.sum(1).tolist()
            rows = all_to_all(send, out_splits, in_splits, self.group)
        # Rows arrive grouped by source rank, then by local expert: regroup by expert.
        labels = torch.arange(self.num_local, device=x.device).repeat(self.ep).repeat_interleave(received.reshape(-1))
        perm = torch.argsort(labels, stable=True)
        per_expert = received.sum(0).tolist()
        self.last_received = per_expert
        out = expert_fn(rows[perm], per_expert)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        out = out[inverse]
        if self.group is not None:
            out = all_to_all(out, in_splits, out_splits, self.group)
        scale = weights.reshape(-1)[order].unsqueeze(-1)
        return x.new_zeros(x.shape).index_add(0, token_of, (out * scale).to(x.dtype))
