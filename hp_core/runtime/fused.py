"""Fused projections at run time: the re-arranged tensor a rank shards, and back.

The plan's ``fused_layouts`` (``hp_core.planner.fused_layout``) say how a fused
parameter's parts sit along its fused dim. ``FusedShards`` turns the model's tensor into
the re-arranged one that contiguous ``Shard`` splits into whole heads of every part
(``rearrange``, at shard time, on meta or real tensors) and a gathered re-arranged tensor
back into the model's own layout (``restore``, on every export path), and gives the
module a private config for the apply's lifetime when the forward reads head counts from
it (``set_local_attr``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hp_core.planner.fused_layout import FusedLayout
from hp_core.runtime.journal import Journal

__all__ = ["FusedShards", "fused_shards", "set_local_attr"]


@dataclasses.dataclass(frozen=True)
class FusedShards:
    """One fused parameter's layout on a tp of ``tp`` ranks."""

    layout: FusedLayout
    tp: int

    def _index(self, device: torch.device) -> torch.Tensor | None:
        index = self.layout.index(self.tp)
        return index.to(device) if index is not None else None

    def rearrange(self, full: torch.Tensor) -> torch.Tensor:
        """The model's tensor in re-arranged order (itself when nothing moves)."""
        index = self._index(full.device)
        return full if index is None else full.index_select(self.layout.dim, index)

    def restore(self, full: torch.Tensor) -> torch.Tensor:
        """A gathered re-arranged tensor in the model's own order."""
        index = self._index(full.device)
        if index is None:
            return full
        out = torch.empty_like(full)
        out.index_copy_(self.layout.dim, index, full)
        return out

    @property
    def moves(self) -> bool:
        return len(self.layout.parts) > 1 and self.tp > 1


def fused_shards(
    fqn: str, layouts: Mapping[str, Any], rel: str, shape: tuple[int, ...], tp: int
) -> FusedShards | None:
    """The ``FusedShards`` of parameter ``rel`` of boundary ``fqn`` (None if not fused).

    The layout is checked against the parameter (a plan document edited by hand, or made for
    another model, is refused with ``FusedProjectionError``).
    """
    data = layouts.get(rel)
    if data is None:
        return None
    where = f"{fqn}.{rel}" if fqn else rel
    layout = FusedLayout.from_data(data, f"plan[{fqn!r}].fused_layouts[{rel!r}]")
    layout.check(where, shape, tp)
    return FusedShards(layout, tp)


def set_local_attr(journal: Journal, module: nn.Module, attr: str, value: int) -> None:
    """``module.<attr> = value``: ``child.<name>`` on that submodule; ``config.<name>`` on a
    private shallow copy of the module's config (made once, journaled), so the model's
    shared config stays global."""
    path, _, leaf = attr.rpartition(".")
    if path and ("." in path or path in module._modules):  # a child's (Conv1D's ``nf``)
        journal.set_attr(module.get_submodule(path), leaf, value)
        return
    if not path:
        journal.set_attr(module, attr, value)
        return
    # A plain object the module holds (its config, a dataclass): the same, on a private copy.
    config = getattr(module, path)
    flag = f"_hp_private_{path}"
    if not getattr(module, flag, False):
        config = copy.copy(config)
        journal.set_attr(module, path, config)
        journal.set_attr(module, flag, True)
    # setattr, not the instance dict: a config maps aliases (GPT-2's n_head) through it. The
    # copy is private, and the journal puts the module's own config back on rollback.
    setattr(config, attr.partition(".")[2], value)
