"""The tp layout of one projection parameter, by its role and its module's kind.

Megatron pairs: a column-parallel projection splits its outputs (``nn.Linear`` weight
``[out, in]``: ``Shard(0)``; GPT-2's ``Conv1D`` weight ``[in, out]``: ``Shard(1)``; the bias
``Shard(0)``), a row-parallel one its inputs (``Shard(1)`` / ``Conv1D``'s ``Shard(0)``; the
bias is whole and added once after the reduction). A fused projection is column-parallel
along its fused dim; ``hp_core.planner.fused_layout`` makes each rank's slice whole heads
of every part.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Shard

from hp_core.planner.fused_layout import local_region
from hp_core.planner.lints import is_conv1d
from hp_core.planner.templates.context import TemplateContext
from hp_core.planner.templates.roles import Role

__all__ = ["projection_param", "region_dispatch"]

_COLUMN = (Role.COLWISE, Role.FUSED_QKV, Role.FUSED_GATE_UP)


def projection_param(ctx: TemplateContext, rel: str, role: Role) -> dict[str, Any] | None:
    """The named placement of projection parameter ``rel``, or None if ``role`` is not one."""
    is_bias = rel.endswith("bias")
    path = rel.rpartition(".")[0]
    owner = ctx.block.module.get_submodule(path) if path else ctx.block.module
    conv = is_conv1d(owner)
    if role in _COLUMN:
        return ctx.tp_param(Shard(1 if conv and not is_bias else 0))
    if role is Role.ROWWISE and not is_bias:
        return ctx.tp_param(Shard(0 if conv else 1))
    return None


def region_dispatch(ctx: TemplateContext) -> bool | None:
    """False when the block's fused projections are re-arranged (its region runs locally)."""
    return False if local_region(ctx.block.module, ctx.block.params, ctx.tp) else None
