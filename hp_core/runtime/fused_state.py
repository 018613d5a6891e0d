"""Validate mode's state dict of re-arranged fused projections: the model's own layout.

A validate parameter of a fused projection is a DTensor of the *re-arranged* tensor
(``hp_core.runtime.fused``), so its plain state dict would save the parts interleaved by
rank. ``FusedStateDict`` hooks ``state_dict`` to give, for each such parameter, a DTensor
of the model's own layout instead (a copy: gathered, put back in order, re-sliced) and
``load_state_dict`` to take a DTensor of any layout or the full tensor in the model's
layout and hand the module the re-arranged DTensor it holds. Production does the same
through its layouts (``hp_core.runtime.fused_views``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hp_core.runtime.fused import FusedShards
from hp_core.runtime.param_layout import ParamLayout
from hp_core.runtime.state_dict import StateDictHooks
from hp_core.runtime.state_views import StateDictLayoutError

__all__ = ["FusedStateDict", "validate_fused_value", "validate_layouts"]


class FusedStateDict(StateDictHooks):
    """The state-dict hooks for a validate model's re-arranged fused parameters."""

    def __init__(self, fused: Mapping[str, FusedShards]) -> None:
        self.fused = dict(fused)  # parameter name in the applied module -> its re-arrangement

    def _on_save(
        self, _module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any
    ) -> dict[str, Any]:
        for name, fused in self.fused.items():
            value = state.get(prefix + name)
            if isinstance(value, DTensor):
                original = fused.restore(value.full_tensor())
                state[prefix + name] = distribute_tensor(
                    original, value.device_mesh, value.placements, src_data_rank=None
                )
        return state

    def _on_load(self, module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        current = dict(module.named_parameters(remove_duplicate=False))
        for name, fused in self.fused.items():
            key, param = prefix + name, current.get(name)
            value = state.get(key)
            if not isinstance(value, torch.Tensor) or not isinstance(param, DTensor):
                continue  # torch's own check names a missing key or a wrong type
            if tuple(value.shape) != tuple(param.shape):
                continue  # torch's own size check names the key and both shapes
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            state[key] = distribute_tensor(
                fused.rearrange(whole.detach()),
                param.device_mesh,
                param.placements,
                src_data_rank=None,
            )


def validate_layouts(model: nn.Module, fused: Mapping[str, FusedShards]) -> dict[str, ParamLayout]:
    """``name -> layout`` of a validate model's re-arranged fused DTensor parameters (what the
    optimizer's state views need to save their moments in the model's own layout)."""
    out: dict[str, ParamLayout] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in fused and isinstance(p, DTensor):
            out[name] = ParamLayout(
                p.device_mesh, tuple(p.placements), p.shape, p.stride(), fused[name]
            )
    return out


def validate_fused_value(key: str, value: torch.Tensor, layout: ParamLayout) -> DTensor:
    """The re-arranged DTensor of ``layout`` from a value in the model's own layout."""
    if tuple(value.shape) != tuple(layout.shape) or layout.fused is None:
        raise StateDictLayoutError(
            f"{key}: the state dict holds a tensor of shape {tuple(value.shape)}, but the "
            f"parameter is {layout.describe()} on this mesh.\n"
            "Fix: load a checkpoint of this model (saved with torch.distributed.checkpoint "
            "or as full tensors)."
        )
    whole = value.full_tensor() if isinstance(value, DTensor) else value
    return distribute_tensor(
        layout.fused.rearrange(whole.detach()), layout.mesh, layout.placements, src_data_rank=None
    )
