"""Count the collectives a piece of code issues, with the bytes this rank sends.

``CollectiveCounter`` is a dispatch mode: it sees every ``c10d`` and functional
collective, whether hp's explicit collectives, DTensor's redistributions or a plugin's
all-to-all issued it. A collective on meta tensors moves nothing (DTensor only computes
its output shape) and is not counted. :func:`count_step` counts one forward and one
backward apart, and :func:`by_phase` folds a prediction
(``hp_core.planner.step_collectives``) to the same ``{phase: {op: count}}`` shape, so a
test compares predicted with measured in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveCounter", "by_phase", "count_step"]

_NAMES = {
    "allgather_base": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "allgather": "all_gather",
    "reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all",
}


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as c: ...`` then ``c.calls`` ({op: count}) and ``c.bytes``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional", "c10d_functional"):
            name = _NAMES.get(func._opname.strip("_"))
            # The in-place c10d ops take (output, input, ...); the functional ones (input, ...).
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            nested = [
                t
                for a in args
                if isinstance(a, list | tuple)
                for t in a
                if isinstance(t, torch.Tensor)
            ]
            src = (
                tensors[1]
                if ns == "c10d" and len(tensors) > 1
                else next(iter(tensors or nested), None)
            )
            if name is not None and not (src is not None and src.is_meta):
                self.calls[name] = self.calls.get(name, 0) + 1
                if src is not None:
                    self.bytes += src.numel() * src.element_size()
        return func(*args, **(kwargs or {}))

    def total(self) -> int:
        return sum(self.calls.values())


def count_step(forward: Callable[[], torch.Tensor]) -> dict[str, dict[str, int]]:
    """``{"forward": {op: n}, "backward": {op: n}}``: ``forward()`` returns the loss, then backward.

    The two passes are counted apart (each by its own :class:`CollectiveCounter`).
    """
    with CollectiveCounter() as fwd:
        loss = forward()
    with CollectiveCounter() as bwd:
        loss.backward()
    return {"forward": dict(fwd.calls), "backward": dict(bwd.calls)}


def by_phase(predicted: Mapping[tuple[str, str, str], int]) -> dict[str, dict[str, int]]:
    """``{(phase, op, axis): n}`` → ``{phase: {op: n}}``, summed over axes (as counted)."""
    out: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
    for (phase, op, _axis), n in predicted.items():
        out.setdefault(phase, {})[op] = out.get(phase, {}).get(op, 0) + n
    return out
