"""A production model's state dict with its layouts: DTensor views over the local shards.

In production mode a sharded parameter is a plain local tensor, so a state dict of plain
tensors says nothing about which slice a rank holds: ``torch.distributed.checkpoint``
would save every rank's shard under one key as if it were replicated and restore the
wrong values. ``apply`` therefore hooks the model's ``state_dict`` and ``load_state_dict``:

* saving exposes each sharded parameter as ``DTensor.from_local(shard, mesh, placements)``
  with its global shape: a view, no copy, so ``dcp.load`` into that state dict writes
  straight into the parameter;
* loading accepts, for such a parameter, a DTensor (redistributed to the parameter's
  layout when it differs: a collective) or a full tensor (each rank keeps its own
  slice, no communication), and refuses anything else, naming the key, the shapes and
  the layout.

Replicated parameters stay plain tensors (identical on every rank, which is what DCP
assumes of a plain tensor). Stacked expert parameters have no layout-carrying state dict
yet: saving or loading a model that has them is refused rather than done wrong.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, distribute_tensor

from hp_core.errors import HpError
from hp_core.runtime.journal import Journal
from hp_core.spec.placements import format_placement

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParamLayout", "ShardedStateDict", "StateDictLayoutError"]


class StateDictLayoutError(HpError, ValueError):
    """A state-dict entry that cannot be a parameter's value in this parallel layout."""


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Where a production parameter's local shard sits in the global tensor."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    def describe(self) -> str:
        names = self.mesh.mesh_dim_names or ()
        spec = ", ".join(
            f"{n}: {format_placement(p)}" for n, p in zip(names, self.placements, strict=True)
        )
        return f"{tuple(self.shape)} as {{{spec}}}"


class ShardedStateDict:
    """The state-dict hooks of one production model (installed by ``apply``, journaled)."""

    def __init__(self, layouts: Mapping[int, ParamLayout], expert_params: int) -> None:
        self.layouts = dict(layouts)  # id(parameter) -> layout
        self.expert_params = expert_params

    def attach(self, model: nn.Module, journal: Journal) -> None:
        """Hook ``model.state_dict`` and ``model.load_state_dict`` (undone on rollback)."""
        saving = model._register_state_dict_hook(self._on_save)
        loading = model._register_load_state_dict_pre_hook(self._on_load, with_module=True)
        journal.record(saving.remove)
        journal.record(loading.remove)

    def _sharded(self, module: nn.Module, prefix: str) -> dict[str, ParamLayout]:
        self._refuse_experts(module)
        return {
            prefix + name: self.layouts[id(p)]
            for name, p in module.named_parameters(remove_duplicate=False)
            if id(p) in self.layouts
        }

    def _refuse_experts(self, module: nn.Module) -> None:
        if self.expert_params:
            raise StateDictLayoutError(
                f"{type(module).__name__}: the state dict of a production model with "
                f"{self.expert_params} stacked expert-parallel parameter(s) does not carry "
                "their layout yet, so a checkpoint of it would restore wrong values.\n"
                "Fix: save this model from validate mode (apply(..., mode='validate'); its "
                "parameters are DTensors), or without expert parallelism."
            )

    def _on_save(
        self, module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any
    ) -> dict[str, Any]:
        for key, layout in self._sharded(module, prefix).items():
            value = state.get(key)
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                state[key] = DTensor.from_local(
                    value,
                    layout.mesh,
                    layout.placements,
                    run_check=False,
                    shape=layout.shape,
                    stride=layout.stride,
                )
        return state

    def _on_load(self, module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        for key, layout in self._sharded(module, prefix).items():
            if key in state:
                state[key] = _local_value(key, state[key], layout)


def _local_value(key: str, value: Any, layout: ParamLayout) -> torch.Tensor:
    """This rank's shard of ``value`` for a parameter laid out as ``layout``."""
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
    if isinstance(value, DTensor):
        if value.device_mesh != layout.mesh or tuple(value.placements) != layout.placements:
            value = value.redistribute(layout.mesh, layout.placements)
        return value.to_local()
    # A full tensor: keep this rank's slice (no communication: every rank holds the whole).
    return distribute_tensor(
        value.detach(), layout.mesh, layout.placements, src_data_rank=None
    ).to_local()
