"""Where a production parameter's local shard sits in its global tensor: ``ParamLayout``.

A production parameter is a plain local tensor; its layout (mesh, placements, global shape
and stride) is what its DTensor would say. ``apply`` records one per sharded parameter,
keyed by the parameter's name in the applied module, and the state-dict and optimizer
views (``hp_core.runtime.state_dict``, ``hp_core.runtime.state_views``) read them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate

from hp_core.runtime.fused import FusedShards
from hp_core.spec.placements import format_placement

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParamLayout", "layout_of", "named_layouts"]


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Where a production parameter's local shard sits in the global tensor."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    #: A fused projection's re-arrangement: the shard is of ``fused.rearrange(tensor)``.
    fused: FusedShards | None = None

    def describe(self) -> str:
        names = self.mesh.mesh_dim_names or ()
        spec = ", ".join(
            f"{n}: {format_placement(p)}" for n, p in zip(names, self.placements, strict=True)
        )
        return f"{tuple(self.shape)} as {{{spec}}}"


def layout_of(dt: DTensor) -> ParamLayout | None:
    """The layout of ``dt``'s local shard, or None when it is replicated everywhere."""
    if all(isinstance(p, Replicate) for p in dt.placements):
        return None
    return ParamLayout(dt.device_mesh, tuple(dt.placements), dt.shape, dt.stride())


def named_layouts(model: nn.Module, by_id: Mapping[int, ParamLayout]) -> dict[str, ParamLayout]:
    """``parameter name → layout`` for every installed parameter of ``model`` in ``by_id``.

    Names, not parameter objects, key the views: a wrapper that swaps the parameter
    objects after apply (FSDP2 on dp) keeps the names. Tied aliases get the same layout.
    """
    return {
        name: by_id[id(p)]
        for name, p in model.named_parameters(remove_duplicate=False)
        if id(p) in by_id
    }
