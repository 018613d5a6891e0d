"""A re-arranged fused parameter's value as a checkpoint sees it (the model's own layout).

A production rank holds its rows of every part of a fused projection
(``hp_core.runtime.fused``): not one contiguous slice of the model's tensor, so no DTensor
of the model's layout can view it. ``fused_saved`` therefore gives the checkpoint a *copy*:
the re-arranged DTensor is gathered, put back in the model's order and re-sliced
contiguously (each rank keeps only its slice of the copy; the gather is transient), so
DCP saves the model's own layout and reshards it to any tp or to one process.
``fused_full`` is the way back: whatever the checkpoint offers (a DTensor of any layout
or the full tensor) is made whole and re-arranged, for the caller to slice. A load
therefore lands in the model through ``load_state_dict`` (what ``hp_core.load_checkpoint``
and ``set_model_state_dict`` call after ``dcp.load``), not by ``dcp.load`` writing into the
saved views. Both are collectives over the parameter's mesh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hp_core.runtime.fused import FusedShards

__all__ = ["fused_full", "fused_saved", "zero_bias"]


def fused_saved(view: DTensor, fused: FusedShards) -> DTensor:
    """A DTensor view of the re-arranged tensor as a DTensor of the model's own layout (a
    copy, with the view's mesh and placements)."""
    original = fused.restore(view.full_tensor())
    return distribute_tensor(original, view.device_mesh, view.placements, src_data_rank=None)


def fused_full(value: torch.Tensor, fused: FusedShards) -> torch.Tensor:
    """The whole re-arranged tensor, from a value in the model's layout (a DTensor or full)."""
    whole = value.full_tensor() if isinstance(value, DTensor) else value
    return fused.rearrange(whole.detach())


def zero_bias(bias: torch.Tensor | None, mesh: DeviceMesh, dispatch: bool) -> torch.Tensor | None:
    """Zeros standing in for a deferred bias a module always adds (GPT-2's ``Conv1D``).

    On DTensors (validate, dispatching region) they are a partial sum on tp, as the rowwise
    product they join; elsewhere plain zeros of this rank's local size.
    """
    if bias is None:
        return None
    local = bias.to_local() if isinstance(bias, DTensor) else bias
    zeros = torch.zeros_like(local.detach())
    if not dispatch:
        return zeros
    names = mesh.mesh_dim_names or ()
    placements = [Partial() if n == "tp" else Replicate() for n in names]
    return DTensor.from_local(zeros, mesh, placements, run_check=False)
