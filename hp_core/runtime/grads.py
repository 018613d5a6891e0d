"""One bucketed all-reduce per step for parameters replicated on tp but fed sequence-sharded data.

Under sequence parallelism a norm weight (or a deferred bias, or a replicated MoE
block) sees only this rank's tokens, so its gradient is a partial sum. DTensor leaves
such gradients ``Partial``; hp sums them across tp once per backward, for all of them
together, as soon as the last one has accumulated. Gradient accumulation works: what
was already reduced before this backward is kept aside and not summed again.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ReplicatedGradSync"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class ReplicatedGradSync:
    """Watches ``params``; after each backward reduces their new gradient over ``group``."""

    def __init__(self, params: list[nn.Parameter], group: Any) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self._pending: set[int] = set()
        self._base: dict[int, torch.Tensor | None] = {}
        self._handles: list[Any] = []
        self._armed = False
        self.reductions = 0
        for p in self.params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._arrived))

    def arm(self) -> None:
        """Called when a forward with grad enabled starts: remember what is already reduced."""
        if not torch.is_grad_enabled():
            return
        self._armed = True
        self._pending = {id(p) for p in self.params}
        self._base = {id(p): (_local(p.grad).detach().clone() if p.grad is not None else None) for p in self.params}

    def _arrived(self, p: torch.Tensor) -> None:
        if not self._pending:
            return
        self._pending.discard(id(p))
        if not self._pending:
            self.flush()

    def flush(self) -> None:
        """Reduce now (also callable by hand, e.g. when some parameter got no gradient).

        A no-op when nothing new arrived since the last reduction, so calling it after the
        automatic reduction does not sum the gradients twice.
        """
        if not self._armed:
            return
        self._armed = False
        self._pending = set()
        with_grad = [p for p in self.params if p.grad is not None]
        if not with_grad:
            return
        news = []
        for p in with_grad:
            g = _local(p.grad)
            base = self._base.get(id(p))
            news.append((g - base) if base is not None else g)
        flat = torch.cat([n.reshape(-1) for n in news])
        dist.all_reduce(flat, group=self.group)
        self.reductions += 1
        offset = 0
        for p, n in zip(with_grad, news, strict=True):
            reduced = flat[offset : offset + n.numel()].view_as(n)
            offset += n.numel()
            base = self._base.get(id(p))
            value = reduced + base if base is not None else reduced
            if isinstance(p, DTensor):
                p.grad = DTensor.from_local(value.contiguous(), p.device_mesh, p.placements, run_check=False)
            else:
                p.grad = value.contiguous()
        self._base = {}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
