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
assumes of a plain tensor). Expert parameters carry their expert-mesh layout. The hooks
look layouts up by parameter name, so they hold when FSDP2 swaps the parameter objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from hp_core.runtime.journal import Journal
from hp_core.runtime.param_layout import ParamLayout
from hp_core.runtime.state_views import StateDictLayoutError, local_value, saved_view

__all__ = [
    "ParamLayout",
    "ShardedStateDict",
    "StateDictHooks",
    "StateDictLayoutError",
]


class StateDictHooks:
    """A pair of state-dict hooks (``_on_save``, ``_on_load``) a model carries while applied."""

    def _on_save(
        self, module: nn.Module, state: dict[str, Any], prefix: str, meta: Any
    ) -> dict[str, Any]:
        raise NotImplementedError

    def _on_load(self, module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        raise NotImplementedError

    def attach(self, model: nn.Module, journal: Journal) -> None:
        """Hook ``model.state_dict`` and ``model.load_state_dict`` (undone on rollback)."""
        saving = model._register_state_dict_hook(self._on_save)
        loading = model._register_load_state_dict_pre_hook(self._on_load, with_module=True)
        journal.record(saving.remove)
        journal.record(loading.remove)


class ShardedStateDict(StateDictHooks):
    """The state-dict hooks of one production model (installed by ``apply``, journaled)."""

    def __init__(self, layouts: Mapping[str, ParamLayout]) -> None:
        self.layouts = dict(layouts)  # parameter name in the applied module -> layout

    def _on_save(
        self, _module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any
    ) -> dict[str, Any]:
        for name, layout in self.layouts.items():
            key = prefix + name
            if key in state:
                state[key] = saved_view(state[key], layout, key)
        return state

    def _on_load(self, module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        current = dict(module.named_parameters(remove_duplicate=False))
        for name, layout in self.layouts.items():
            key = prefix + name
            if key in state:
                state[key] = local_value(key, state[key], layout, like=current.get(name))
