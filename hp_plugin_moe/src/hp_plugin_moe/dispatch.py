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
with nothing to send or receive, so the collectives always match up. The uneven
all-to-all is the core's :func:`hp_core.collectives.all_to_all`;
:func:`moe_block_collectives` declares these five to hp's prediction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hp_core.collectives import Collective, all_to_all

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["TokenDispatcher", "moe_block_collectives"]


ExpertFn = Callable[[torch.Tensor, list[int]], torch.Tensor]


class TokenDispatcher:
    """Dispatch → local experts → combine for one MoE block (``group=None``: no expert parallelism).

    ``capacity_factor`` bounds what each rank sends to each expert per call to
    ``ceil(capacity_factor * T * K / E)`` (T local tokens, K experts per token, E
    experts); pairs beyond it are dropped in token order and contribute nothing.
    ``last_dropped`` / ``last_received`` describe the latest call.
    """

    def __init__(
        self, num_experts: int, group: ProcessGroup | None, *, capacity_factor: float | None = None
    ) -> None:
        self.num_experts = num_experts
        self.group = group
        self.ep = dist.get_world_size(group) if group is not None else 1
        self.num_local = num_experts // self.ep
        self.capacity_factor = capacity_factor
        self.last_dropped = 0
        self.last_received: list[int] = []

    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, expert_fn: ExpertFn
    ) -> torch.Tensor:
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
        labels = (
            torch.arange(self.num_local, device=x.device)
            .repeat(self.ep)
            .repeat_interleave(received.reshape(-1))
        )
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


def moe_block_collectives(sizes: Mapping[str, int], config: Mapping[str, Any]) -> list[Collective]:
    """The collectives of one MoE block call over ``sizes["ep"]`` expert ranks (none without EP).

    Forward: the counts, the dispatch and the combine all-to-all; backward: the adjoints of
    dispatch and combine.
    """
    if int(sizes.get("ep", 1)) <= 1:
        return []
    where = "moe token dispatch"
    fwd = [
        Collective("all_to_all", "ep", "forward", f"{where} {step}")
        for step in ("counts", "rows", "combine")
    ]
    bwd = [
        Collective("all_to_all", "ep", "backward", f"{where} {step}")
        for step in ("rows", "combine")
    ]
    return fwd + bwd
