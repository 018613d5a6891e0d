"""One value of a production parameter, as a checkpoint sees it and back.

``saved_view`` turns what a production model holds for a sharded parameter (its plain
local shard) into the DTensor that says where the shard sits, without a copy;
``local_value`` turns whatever a checkpoint offers for it (a DTensor of any layout, or the
full tensor) into this rank's shard, and refuses anything else with the key, both shapes
and the layout. The model's state-dict hooks and the optimizer's use the same two
functions, so a parameter and its optimizer moments are saved and restored alike.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from hp_core.errors import HpError
from hp_core.runtime.fsdp_views import combined_view, fsdp_local, is_fsdp_shard
from hp_core.runtime.fused_views import fused_full, fused_saved
from hp_core.runtime.param_layout import ParamLayout

__all__ = ["StateDictLayoutError", "local_value", "saved_view"]


class StateDictLayoutError(HpError, ValueError):
    """A state-dict entry that cannot be a parameter's value in this parallel layout."""


def saved_view(value: Any, layout: ParamLayout, key: str = "") -> Any:
    """``value`` (a local shard) as a DTensor view with ``layout``; anything else unchanged.

    FSDP2's dp DTensor of the local shard becomes one DTensor over dp and ``layout``'s
    mesh dims (``hp_core.runtime.fsdp_views``); ``key`` names it in errors.
    """
    if isinstance(value, DTensor) and is_fsdp_shard(value, layout):
        view = combined_view(key or layout.describe(), value, layout)
    elif isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        view = DTensor.from_local(
            value,
            layout.mesh,
            layout.placements,
            run_check=False,
            shape=layout.shape,
            stride=layout.stride,
        )
    else:
        return value
    # A fused projection's shard is of the re-arranged tensor: saved as the model's (a copy).
    return fused_saved(view, layout.fused) if layout.fused is not None else view


def local_value(key: str, value: Any, layout: ParamLayout, like: torch.Tensor | None = None) -> Any:
    """This rank's shard of ``value`` for a parameter laid out as ``layout``.

    ``like`` is what the model (or optimizer) holds for that key now, when known; the
    result has its form, so a wrapper that keeps its own tensors (FSDP2 on dp) gets them.
    """
    if not isinstance(value, torch.Tensor):
        return value  # torch's own check names the key and the type
    if tuple(value.shape) != tuple(layout.shape):
        what = "DTensor" if isinstance(value, DTensor) else "tensor"
        raise StateDictLayoutError(
            f"{key}: the state dict holds a {what} of shape {tuple(value.shape)}, but the "
            f"parameter is {layout.describe()} on this mesh.\n"
            "A sharded parameter loads from a DTensor or from the full tensor, never from "
            "one rank's local shard.\n"
            "Fix: load a checkpoint of this model (saved with torch.distributed.checkpoint "
            "or as full tensors), not a state dict of plain local shards."
        )
    if layout.fused is not None:  # this rank's shard is of the re-arranged tensor
        value = fused_full(value, layout.fused)
    if isinstance(like, DTensor) and is_fsdp_shard(like, layout):
        return fsdp_local(key, value, layout, like)
    if isinstance(value, DTensor) and layout.fused is None:
        if value.device_mesh != layout.mesh or tuple(value.placements) != layout.placements:
            value = value.redistribute(layout.mesh, layout.placements)
        return value.to_local()
    # A full tensor: keep this rank's slice (no communication: every rank holds the whole).
    return distribute_tensor(
        value.detach(), layout.mesh, layout.placements, src_data_rank=None
    ).to_local()
