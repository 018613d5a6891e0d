"""Randomness under tp: the same draws where values are replicated, others where sharded.

A dropout on a tp-replicated value must draw the same mask on every tp rank, or the
replicas drift apart; a dropout on a tp-sharded value (attention probabilities of this
rank's heads) must draw a different one on every rank, or the shards get correlated masks.
This is Megatron's RNG-tracker rule. hp keeps it without trusting the user's seeding:

* The ranks of each tp group agree on a base seed when the plan is applied.
* In training mode, every forward of the model starts from a generator state derived from
  (base, step): identical on the tp ranks, so whatever the model's own code draws on
  replicated values matches. The user's generator is put back when the forward returns.
* A region whose computation is sharded on tp (its parameters or its inputs) draws from a
  state derived from (base, step, region, call, tp rank) and, on exit, leaves the outer
  stream as it was.

States are derived, not carried along, so activation checkpointing replays them: the
recomputation of a region in backward gets the state its forward had.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from hp_core.runtime.journal import Journal

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["RngStreams"]


def _seed(*parts: Any) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class _Generator:
    """Get, set and derive the default generator state of one device type."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.module = None if device_type == "cpu" else getattr(torch, device_type, None)

    def get(self) -> torch.Tensor:
        return torch.get_rng_state() if self.module is None else self.module.get_rng_state()

    def set(self, state: torch.Tensor) -> None:
        if self.module is None:
            torch.set_rng_state(state)
        else:
            self.module.set_rng_state(state)

    def derive(self, seed: int) -> None:
        if self.module is None:
            torch.default_generator.manual_seed(seed)
        else:
            self.module.manual_seed(seed)


class RngStreams:
    """The tp-shared and tp-local random streams of one parallelized model."""

    def __init__(self, mesh: DeviceMesh, axis: str = "tp") -> None:
        names = list(mesh.mesh_dim_names or ())
        self.active = axis in names and mesh[axis].size() > 1
        self.gen = _Generator(mesh.device_type)
        self.rank = mesh.get_local_rank(axis) if self.active else 0
        self.base = self._agree(mesh, axis) if self.active else 0
        self.step = 0
        self.calls: dict[str, int] = {}
        self.replays: dict[str, int] = {}
        self._user: torch.Tensor | None = None
        self._on = False

    @staticmethod
    def _agree(mesh: DeviceMesh, axis: str) -> int:
        """The tp group's base seed: its first rank's initial seed (one broadcast, at apply)."""
        device = torch.device("cpu")
        if mesh.device_type != "cpu":
            device = torch.device(
                mesh.device_type, torch.get_device_module(mesh.device_type).current_device()
            )
        seed = torch.tensor(
            [torch.initial_seed() & ((1 << 62) - 1)], dtype=torch.int64, device=device
        )
        group = mesh.get_group(axis)
        dist.broadcast(seed, src=dist.get_global_rank(group, 0), group=group)
        return int(seed.item())

    # ------------------------------------------------------------------ model
    def attach(self, model: nn.Module, journal: Journal) -> None:
        if not self.active:
            return
        pre = model.register_forward_pre_hook(lambda m, _a: self._enter(m))
        post = model.register_forward_hook(lambda _m, _a, _o: self._exit(), always_call=True)
        journal.record(pre.remove)
        journal.record(post.remove)

    def _enter(self, model: nn.Module) -> None:
        if not self.active or not model.training or self._on:
            return
        self._on = True
        self.step += 1
        self.calls = {}
        self.replays = {}
        self._user = self.gen.get()
        self.gen.derive(_seed(self.base, self.step, "model"))

    def _exit(self) -> None:
        if not self._on:
            return
        self._on = False
        if self._user is not None:
            self.gen.set(self._user)
            self._user = None

    # ------------------------------------------------------------------ regions
    @contextlib.contextmanager
    def sharded_region(self, fqn: str) -> Iterator[None]:
        """Draw from this rank's own stream inside a region whose computation is tp-sharded."""
        replay = torch._C._current_graph_task_id() != -1  # recomputed in backward (checkpointing)
        if not self.active or not (self._on or replay):
            yield
            return
        counts = self.replays if replay else self.calls
        call = counts.get(fqn, 0)
        counts[fqn] = call + 1
        outer = self.gen.get()
        self.gen.derive(_seed(self.base, self.step, fqn, call, self.rank))
        try:
            yield
        finally:
            self.gen.set(outer)
