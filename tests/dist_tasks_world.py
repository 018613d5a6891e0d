"""Module-level tasks for tests/test_world.py (tasks must be importable by the ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_rank() -> tuple[int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def fail_on_rank(bad: int) -> int:
    if dist.get_rank() == bad:
        raise ValueError(f"boom on rank {bad}")
    return dist.get_rank()


def hang_unless_rank0() -> None:
    if dist.get_rank() != 0:
        dist.barrier()  # rank 0 never joins
