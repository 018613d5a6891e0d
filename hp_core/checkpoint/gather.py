"""One state-dict value's full tensor: all-gathered to every rank, or gathered to rank 0.

``full_value`` is what the export calls per entry. A production shard gets its recorded
layout first (the DTensor view ``saved_view`` builds, no copy; for FSDP2's DTensor over
dp of hp's value, one DTensor over dp and hp's dims). Then:

* every rank wanting the tensor: ``DTensor.full_tensor()`` (an all-gather, any layout);
* rank 0 only, and the tensor is split into even pieces along one dimension of a 1-D
  mesh (tp): the ranks of the mesh that holds rank 0 send their piece to
  rank 0 (``dist.gather``) and keep no full tensor; the other meshes' ranks (other dp
  replicas of the same shards) do nothing. The senders' memory does not grow, and on
  gloo the export of benchmarks/export_memory.py runs 6x faster than with all-gathers;
* any other layout (the 2-D expert mesh, FSDP2's dp x tp views): the all-gather.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from hp_core.runtime.param_layout import ParamLayout
from hp_core.runtime.state_views import saved_view

__all__ = ["full_value"]

#: What ``_to_rank0`` returns for a layout it does not gather (the caller all-gathers).
_UNHANDLED = object()


def full_value(value: Any, layout: ParamLayout | None, rank0_only: bool, key: str = "") -> Any:
    """The full tensor of one state-dict value (collective for DTensors and hp's shards);
    None on a rank that does not get it (``rank0_only`` and not rank 0)."""
    if layout is not None:  # hp's shard, or FSDP2's dp DTensor of it: one DTensor over both
        value = saved_view(value, layout, key)
    if not isinstance(value, DTensor):
        return value
    if rank0_only:
        out = _to_rank0(value)
        if out is not _UNHANDLED:
            return out
    return value.full_tensor()


def _to_rank0(dt: DTensor) -> Any:
    """``dt`` gathered on global rank 0 (None elsewhere), or ``_UNHANDLED``."""
    mesh = dt.device_mesh
    if mesh.ndim != 1 or type(dt.placements[0]) is not Shard:
        return _UNHANDLED
    dim = dt.placements[0].dim
    local = dt.to_local()
    ranks = mesh.mesh.flatten().tolist()
    if local.shape[dim] * len(ranks) != dt.shape[dim]:
        return _UNHANDLED  # uneven pieces: gather needs one size
    if 0 not in ranks:
        return None  # rank 0's mesh gathers; this one holds the same pieces again
    group = mesh.get_group()
    local = local.contiguous()
    if dist.get_rank() != 0:
        dist.gather(local, None, dst=0, group=group)
        return None
    # Piece i comes from the group's rank i, the order DTensor's own collectives use
    # (distribute_tensor, full_tensor), also on a mesh that lists its ranks out of order.
    full = torch.empty(dt.shape, dtype=local.dtype, device=local.device)
    if dim == 0:  # the pieces are contiguous rows of the result: receive in place
        dist.gather(local, list(full.chunk(len(ranks))), dst=0, group=group)
        return full
    pieces = [torch.empty_like(local) for _ in ranks]
    dist.gather(local, pieces, dst=0, group=group)
    torch.cat(pieces, dim=dim, out=full)
    return full
