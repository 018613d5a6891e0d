"""Full-width q/k norms in an attention block: sharded with the heads, reduced over tp.

A norm whose weight is as long as a tp-sharded projection's whole output (heads x
head_dim: OLMo-2, OLMo-3, OLMoE) meets only this rank's slice of that output. Such a
norm is found from structure — a child module of the attention block whose parameters
are all 1-D of one length, equal to the output width of a projection the block shards
``Shard(0)`` on tp, and not the per-head width (``head_dim``: Qwen3's per-head norms stay
replicated). Its parameters are sharded ``Shard(0)`` like the projection's rows, and the
attention boundary gets the ``sharded_qk_norm`` inner wrapper, which makes the norm's
mean over the feature dim global with one small all-reduce per norm per pass
(:mod:`hp_core.planner.sharded_norm`). Under cp the attention's inner-wrapper slot
belongs to CP's wrapper, so such a block is left as it was (the verifier refuses it;
keep it whole on tp there).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Shard

from hp_core.injection import Target
from hp_core.planner.sharded_norm import SHARDED_QK_NORM
from hp_core.planner.templates.context import TemplateContext
from hp_core.spec.module_spec import ModuleShardingSpec

__all__ = ["full_width_norms", "shard_full_width_norms"]


def _norm_width(module: nn.Module) -> int | None:
    """The common length of a module's parameters when they are all 1-D (a norm), else None."""
    params = list(module.parameters(recurse=False))
    if not params or any(p.dim() != 1 for p in params) or list(module.children()):
        return None
    widths = {int(p.shape[0]) for p in params}
    return widths.pop() if len(widths) == 1 else None


def full_width_norms(ctx: TemplateContext, params: dict[str, dict]) -> dict[str, int]:
    """Child path → width of each norm of the block spanning a tp-sharded projection's output."""
    block = ctx.block.module
    sharded_widths = set()
    for rel, layout in params.items():
        if rel.endswith("weight") and layout.get("tp") == Shard(0):
            shape = ctx.block.shapes.get(rel)
            if shape is not None and len(shape) == 2:
                sharded_widths.add(int(shape[0]))
    head_dim = getattr(block, "head_dim", None)
    found: dict[str, int] = {}
    for path, child in block.named_modules():
        if not path or isinstance(child, nn.Linear | nn.Embedding):
            continue
        width = _norm_width(child)
        if width is None or width not in sharded_widths or width == head_dim:
            continue
        rels = [f"{path}.{name}" for name, _ in child.named_parameters(recurse=False)]
        if all(rel in params and _replicated_on_tp(params[rel]) for rel in rels):
            found[path] = width
    return found


def _replicated_on_tp(layout: dict) -> bool:
    return not isinstance(layout.get("tp"), Shard)


def shard_full_width_norms(ctx: TemplateContext, spec: ModuleShardingSpec) -> ModuleShardingSpec:
    """Shard the block's full-width norms with its heads and install the sharded norm."""
    if not ctx.has_tp or ctx.tp == 1 or "cp" in ctx.mesh or not isinstance(spec.params, dict):
        return spec
    norms = full_width_norms(ctx, spec.params)
    if not norms:
        return spec
    for path in norms:
        for name, _ in ctx.block.module.get_submodule(path).named_parameters(recurse=False):
            spec.params[f"{path}.{name}"] = ctx.tp_param(Shard(0))
    spec.inner_target = "self"
    spec.inner_wrapper = Target(SHARDED_QK_NORM, {"norms": norms})
    spec.region_dispatch = True
    return spec
