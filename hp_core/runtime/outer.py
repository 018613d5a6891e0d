"""Data-parallel wrappers around an hp model must stay off the tp/cp/ep ranks.

``DistributedDataParallel`` averages gradients and broadcasts the module's state over its
process group. Over a group that holds ranks of one tp (or cp, ep) group — the default
world group, which is what HF ``Trainer`` (through accelerate) uses — it overwrites each
rank's shards with rank 0's at wrap time and then averages unrelated shards: training
goes wrong with no error. DDP offers no hook at wrap time, so the check runs in the
model's first root pre-hook of every forward: it looks a few frames up for the DDP
forward that called the model (a handful of attribute reads; the group is inspected once
per wrapper) and refuses before the forward's first collective.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hp_core.errors import HpError
from hp_core.mesh import is_data_axis
from hp_core.runtime.journal import Journal

if TYPE_CHECKING:
    from types import FrameType

    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["OuterWrapperCheck", "WrappedOverModelParallelRanksError"]

_DDP_CODES = frozenset(
    {DistributedDataParallel.forward.__code__, DistributedDataParallel._run_ddp_forward.__code__}
)
#: Frames between the DDP forward and this hook: _run_ddp_forward → Module._wrapped_call_impl
#: → Module._call_impl → the hook; a few more for wrappers in between (accelerate's autocast).
_DEPTH = 12


class WrappedOverModelParallelRanksError(HpError, RuntimeError):
    """A DDP wrapper's process group includes ranks that hold different shards of this model."""


class OuterWrapperCheck:
    """Refuses a forward called through DDP over a group that spans a tp/cp/ep group."""

    def __init__(self, model_name: str, mesh: DeviceMesh) -> None:
        self.model_name = model_name
        names = [str(n) for n in (mesh.mesh_dim_names or ())]
        self.peers: dict[str, set[int]] = {}
        for axis, size in zip(names, mesh.shape, strict=True):
            if int(size) > 1 and not is_data_axis(axis):
                self.peers[axis] = set(dist.get_process_group_ranks(mesh.get_group(axis)))
        self.dp_axes = [a for a in names if is_data_axis(a)]
        self.checked: set[int] = set()

    def attach(self, model: nn.Module, journal: Journal) -> None:
        if not self.peers:
            return
        handle = model.register_forward_pre_hook(lambda m, _a: self._hook(m))
        journal.record(handle.remove)

    def _hook(self, model: nn.Module) -> None:
        frame: FrameType | None = sys._getframe(1)
        for _ in range(_DEPTH):
            if frame is None:
                return
            if frame.f_code in _DDP_CODES:
                wrapper = frame.f_locals.get("self")
                if isinstance(wrapper, DistributedDataParallel) and wrapper.module is model:
                    self.check(wrapper)
                return
            frame = frame.f_back

    def check(self, wrapper: DistributedDataParallel) -> None:
        if id(wrapper) in self.checked:
            return
        ranks = set(dist.get_process_group_ranks(wrapper.process_group))
        me = dist.get_rank()
        for axis, peers in self.peers.items():
            shared = sorted((ranks & peers) - {me})
            if shared:
                dp = (
                    f"mesh[{self.dp_axes[0]!r}].get_group()"
                    if self.dp_axes
                    else "the dp group (a mesh with a dp axis)"
                )
                raise WrappedOverModelParallelRanksError(
                    f"{self.model_name} is wrapped in DistributedDataParallel over ranks "
                    f"{sorted(ranks)}, which include rank(s) {shared} of this rank's {axis} group: "
                    "DDP would broadcast and average shards that differ by design, and train "
                    "wrongly without an error. Wrap it over the data-parallel ranks only: "
                    f"DistributedDataParallel(model, process_group={dp}), or use FSDP2 "
                    "(fully_shard(model, mesh=mesh['dp'])). With HF Trainer use "
                    "hp_core.hf_trainer.HpTrainer(..., mesh=mesh) (docs/training.md)."
                )
        self.checked.add(id(wrapper))
