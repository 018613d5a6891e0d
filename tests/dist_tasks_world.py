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


class _Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("cannot travel")
        self.payload = lambda: None


def raise_unpicklable() -> None:
    raise _Unpicklable()


def return_unpicklable():
    return lambda: None


def fail_rank1_while_rank0_waits() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 gave up")
    dist.barrier()


def die_on_rank1() -> None:
    import os

    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def count_with_probe() -> tuple[dict, int, int]:
    from hp_core.testing.probe import CollectiveCounter

    with CollectiveCounter() as c:
        x = torch.ones(4)
        dist.all_reduce(x)
        out = torch.empty(8)
        dist.all_gather_single(out, torch.ones(4))
        a2a = torch.empty(4)
        dist.all_to_all_single(a2a, torch.ones(4))
    return c.calls, c.bytes, c.total()
