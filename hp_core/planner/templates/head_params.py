"""Attention parameters whose layout follows the heads rather than their name's role.

Refines what the role-based pairing gives an attention block: an MLA block's latent and
per-head projections (:mod:`hp_core.planner.templates.mla`) and per-head weights such as
sinks or per-head norms (:mod:`hp_core.planner.templates.per_head`) get the layout of the
heads they belong to.
"""

from __future__ import annotations

from torch.distributed.tensor import Shard

from hp_core.planner.templates.context import TemplateContext
from hp_core.planner.templates.mla import latent_projections
from hp_core.planner.templates.per_head import per_head_params

__all__ = ["head_params", "mla_divide_attrs"]

#: Head-count attributes an MLA module may keep (divided by tp with its heads).
_HEAD_ATTRS = ("num_heads", "num_attention_heads")


def _heads_sharded(params: dict[str, dict]) -> bool:
    return any(isinstance(n.get("tp"), Shard) for n in params.values())


def head_params(ctx: TemplateContext, params: dict[str, dict]) -> dict[str, dict]:
    """``params`` with MLA projections and per-head weights laid out with the heads."""
    if not ctx.has_tp:
        return params
    out = dict(params)
    mla = latent_projections(ctx.block.module)
    if mla is not None:
        for rel in ctx.block.params:
            leaf, _, kind = rel.rpartition(".")
            if leaf in mla.up:
                out[rel] = ctx.tp_param(Shard(0))
            elif leaf in mla.out:
                out[rel] = ctx.tp_param(Shard(1)) if kind == "weight" else ctx.replicated()
            elif leaf in mla.down:
                out[rel] = ctx.replicated()
    if _heads_sharded(out):
        for rel in per_head_params(ctx.block):
            out[rel] = ctx.tp_param(Shard(0))
    return out


def mla_divide_attrs(ctx: TemplateContext) -> list[str] | None:
    """The head-count attributes of an MLA module, divided by tp like its heads."""
    module = ctx.block.module
    if not ctx.has_tp or latent_projections(module) is None:
        return None
    return [a for a in _HEAD_ATTRS if isinstance(getattr(module, a, None), int)] or None
