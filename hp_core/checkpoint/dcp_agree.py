"""Every rank fails or none does: ``any_failed`` and ``agree``, an all-reduce of a failure flag.

A rank-local problem (a file only this rank reads, a corrupt item in its shard) must stop
every rank, or the healthy ranks would load a model the failing rank does not have. Each
rank passes its own problem (or None); one all-reduce tells all ranks whether any failed,
and only then (the failure path) are the messages gathered, so the failing rank raises
its own error and every other rank raises the same class, the message prefixed with
``rank N:``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from hp_core.checkpoint.dcp_errors import CheckpointError, CheckpointLoadError, error_class

__all__ = ["agree", "any_failed", "unwrap"]


def any_failed(
    failed: bool, device: torch.device, groups: Sequence[ProcessGroup | None] = (None,)
) -> bool:
    """Whether any rank failed: a MAX all-reduce of the flag over each of ``groups`` in turn
    (``None`` is the whole world; the dims of a mesh, one after the other, cover the mesh)."""
    flag = torch.tensor([1 if failed else 0], device=device, dtype=torch.int32)
    if dist.is_available() and dist.is_initialized():
        for group in groups:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def agree(problem: CheckpointError | None, device: torch.device) -> None:
    """Raise on every rank when ``problem`` is not None on any rank (a collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if problem is not None:
            raise problem
        return
    if not any_failed(problem is not None, device):
        return
    mine = None if problem is None else (type(problem).__name__, str(problem))
    gathered: list[tuple[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if problem is not None:
        raise problem
    rank, (name, message) = next((r, p) for r, p in enumerate(gathered) if p is not None)
    raise error_class(name)(f"rank {rank}: {message}")


def unwrap(failures: Mapping[int, tuple[BaseException, object]], root: str) -> CheckpointError:
    """The error a ``CheckpointException`` stands for, seen from this rank."""
    me = dist.get_rank() if dist.is_initialized() else 0
    rank = me if me in failures else min(failures)
    err = failures[rank][0]
    if isinstance(err, CheckpointError):
        return err if rank == me else error_class(type(err).__name__)(f"rank {rank}: {err}")
    # Not raised by the checked reader (the planner, a collective): name it as it is.
    prefix = "" if rank == me else f"rank {rank}: "
    return CheckpointLoadError(
        f"{prefix}{root}: the checkpoint load failed ({type(err).__name__}: {err}).\n"
        "Fix: remove the chained cause (its traceback is above), then load again."
    )
