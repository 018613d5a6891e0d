"""Boundary templates for single modules: a Linear on its own, and a module kept whole.

A decoder layer whose MLP has no module of its own (OPT, BioGPT: ``fc1``/``fc2`` beside
``self_attn``) gets one boundary per Linear: the column-parallel one gathers its input
and leaves its output sharded on the last dim (the activation between runs on that
shard in the layer's code), the row-parallel one takes that shard and returns a partial
sum, reduced into the residual stream's layout. ``keep`` leaves a module whole on tp: it reads
and returns whole tensors (a position embedding: its output is added to the token
embedding's, which is whole).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from hp_core.planner.lints import PlanningError
from hp_core.planner.templates.context import TemplateContext
from hp_core.planner.templates.roles import BoundaryTemplate
from hp_core.spec.module_spec import ModuleShardingSpec
from hp_core.spec.placements import NamedPlacement

__all__ = ["SINGLE_MODULE_TEMPLATES"]


def _stream(ctx: TemplateContext) -> NamedPlacement:
    """The residual stream's layout for this Linear's activation rank (tokens may be flat)."""
    seq = ctx.block.ndim - 2
    return ctx.layout(tp=Shard(seq) if ctx.sp_active else Replicate())


def _features(ctx: TemplateContext) -> NamedPlacement:
    return ctx.layout(tp=Shard(ctx.block.ndim - 1))


def _check_cp(ctx: TemplateContext) -> None:
    if ctx.block.in_attention and ctx.cp > 1:
        layer = ctx.fqn.rpartition(".")[0]
        raise PlanningError(
            f"{ctx.fqn}: this projection feeds or reads an attention product computed in "
            f"{layer!r}'s own code, which hp cannot make context-parallel (each rank would attend "
            f"only to its own part of the sequence, cp={ctx.cp}). Fix: plan without cp, or move "
            "the attention into a module of its own (its projections as children)."
        )


def linear_colwise(ctx: TemplateContext) -> ModuleShardingSpec:
    _check_cp(ctx)
    x = ctx.first_input()
    params = {rel: ctx.tp_param(Shard(0)) for rel in ctx.block.params}
    return ModuleShardingSpec(
        params={k: v for k, v in params.items() if v},
        in_src=ctx.io(x, _stream(ctx)),
        in_dst=ctx.io(x, ctx.gathered),
        out_src=ctx.io("output", _features(ctx)),
        out_dst=ctx.io("output", _features(ctx)),
    )


def linear_rowwise(ctx: TemplateContext) -> ModuleShardingSpec:
    _check_cp(ctx)
    x = ctx.first_input()
    params = {
        rel: ctx.tp_param(Shard(1)) if rel == "weight" else ctx.replicated()
        for rel in ctx.block.params
    }
    return ModuleShardingSpec(
        params={k: v for k, v in params.items() if v},
        in_src=ctx.io(x, _features(ctx)),
        in_dst=ctx.io(x, _features(ctx)),
        out_src=ctx.io("output", ctx.partial if ctx.has_tp else ctx.gathered),
        out_dst=ctx.io("output", _stream(ctx)),
    )


def keep(ctx: TemplateContext) -> ModuleShardingSpec:
    """Whole on tp: replicated parameters, whole input and output (it declares them, so
    the verifier knows which tokens its parameters' gradients see)."""
    x = ctx.first_input()
    params = {rel: ctx.replicated() for rel in ctx.block.params}
    return ModuleShardingSpec(
        params={k: v for k, v in params.items() if v},
        in_src=ctx.io(x, ctx.gathered),
        in_dst=ctx.io(x, ctx.gathered),
        out_src=ctx.io("output", ctx.gathered),
        out_dst=ctx.io("output", ctx.gathered),
    )


SINGLE_MODULE_TEMPLATES: tuple[BoundaryTemplate, ...] = (
    BoundaryTemplate("boundary.linear_colwise", "linear_colwise", linear_colwise),
    BoundaryTemplate("boundary.linear_rowwise", "linear_rowwise", linear_rowwise),
    BoundaryTemplate("boundary.keep", "keep", keep),
)
