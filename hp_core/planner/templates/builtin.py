"""The core's boundary templates (registered by the built-in plugin like any other).

Megatron-style tensor parallelism with sequence parallelism between blocks, vocab-
parallel embedding and lm_head, context parallelism as sequence sharding on ``cp``,
and MoE blocks marked for expert parallelism.
"""

from __future__ import annotations

from torch.distributed.tensor import Shard

from hp_core.planner.lints import FusedProjectionError
from hp_core.planner.templates.context import TemplateContext
from hp_core.planner.templates.head_params import head_params, mla_divide_attrs
from hp_core.planner.templates.mixers import second_activation, whole_block, whole_reason
from hp_core.planner.templates.projections import projection_param, region_dispatch
from hp_core.planner.templates.qk_norm import shard_full_width_norms
from hp_core.planner.templates.roles import BoundaryTemplate, Role
from hp_core.plugins import suggest_compute_factory
from hp_core.spec.module_spec import ModuleShardingSpec, layout_map

__all__ = ["DEFAULT_BOUNDARY_TEMPLATES", "FusedProjectionError"]


def _pair_params(ctx: TemplateContext) -> dict[str, dict]:
    params: dict[str, dict] = {}
    for rel, role in ctx.block.params.items():
        placed = projection_param(ctx, rel, role)
        # Rowwise biases (added once after the reduction), per-head norms, ...: whole.
        params[rel] = placed if placed is not None else ctx.replicated()
    return {k: v for k, v in params.items() if v}


def attention(ctx: TemplateContext) -> ModuleShardingSpec:
    out = "attn_output" if ctx.returns_tuple() else "output"
    if ctx.has_tp and whole_reason(ctx.block) is not None:
        return whole_block(ctx, out, [out, "attn_weights"] if ctx.returns_tuple() else None)
    spec = ModuleShardingSpec(
        params=head_params(ctx, _pair_params(ctx)),
        in_src=ctx.inputs_io(ctx.hidden),
        in_dst=ctx.inputs_io(ctx.gathered),
        out_src=ctx.io(out, ctx.partial if ctx.has_tp else ctx.gathered),
        out_dst=ctx.io(out, ctx.hidden),
        out_names=[out, "attn_weights"] if ctx.returns_tuple() else None,
        tp_divide_attrs=mla_divide_attrs(ctx),
        region_dispatch=region_dispatch(ctx),
    )
    spec.with_derived(needs_cp_attn=True)
    return shard_full_width_norms(ctx, spec)  # norms over the whole q/k width (OLMo-2)


def mlp(ctx: TemplateContext) -> ModuleShardingSpec:
    if ctx.has_tp and whole_reason(ctx.block) is not None:
        spec = whole_block(ctx, "output", None)
        extra = second_activation(ctx.block.module)
        if extra is not None:  # it arrives as the first does, and is gathered the same way
            spec.in_src = {**layout_map(spec.in_src), **ctx.io(extra, ctx.hidden)}
            spec.in_dst = {**layout_map(spec.in_dst), **ctx.io(extra, ctx.gathered)}
        return spec
    return ModuleShardingSpec(
        params=_pair_params(ctx),
        in_src=ctx.inputs_io(ctx.hidden),
        in_dst=ctx.inputs_io(ctx.gathered),
        out_src=ctx.io("output", ctx.partial if ctx.has_tp else ctx.gathered),
        out_dst=ctx.io("output", ctx.hidden),
        region_dispatch=region_dispatch(ctx),
    )


def embed(ctx: TemplateContext) -> ModuleShardingSpec:
    """Vocab-parallel embedding: each rank looks up its vocabulary slice, then all-reduce.

    Token ids carry no gradient, so only their cp layout is declared.
    """
    x = ctx.first_input()
    params = {rel: ctx.tp_param(Shard(0)) for rel in ctx.block.params}
    ids = ctx.layout(tp=None)
    return ModuleShardingSpec(
        params={k: v for k, v in params.items() if v},
        in_src=ctx.io(x, ids),
        in_dst=ctx.io(x, ids),
        out_src=ctx.io("output", ctx.partial if ctx.has_tp else ctx.gathered),
        out_dst=ctx.io("output", ctx.embed_out),
    )


def lm_head(ctx: TemplateContext) -> ModuleShardingSpec:
    x = ctx.first_input()
    params = {rel: ctx.tp_param(Shard(0)) for rel in ctx.block.params}
    vocab = ctx.layout(tp=Shard(2))
    spec = ModuleShardingSpec(
        params={k: v for k, v in params.items() if v},
        # A final norm whose output model code reshapes hands it over whole (see norm).
        in_src=ctx.io(x, ctx.gathered if ctx.block.whole_in else ctx.hidden),
        in_dst=ctx.io(x, ctx.gathered),
        out_src=ctx.io("output", vocab),
        out_dst=ctx.io("output", vocab if ctx.loss_parallel else ctx.gathered),
    )
    spec.with_derived(is_terminal=True)
    return spec


def norm(ctx: TemplateContext) -> ModuleShardingSpec:
    """A norm runs on the tokens this rank holds. A final norm whose output the model's own
    code reshapes with whole-sequence shapes before the head (GPT-2's ``view(output_shape)``)
    gathers it on exit: the head then reads it whole, so it is still one all-gather."""
    params = {rel: ctx.replicated() for rel in ctx.block.params}
    return ModuleShardingSpec(
        params={k: v for k, v in params.items() if v},
        in_src=ctx.inputs_io(ctx.hidden),
        in_dst=ctx.inputs_io(ctx.hidden),
        out_src=ctx.io("output", ctx.hidden),
        out_dst=ctx.io("output", ctx.gathered if ctx.block.whole_out else ctx.hidden),
    )


def moe(ctx: TemplateContext) -> ModuleShardingSpec:
    """A MoE block computes token by token: it runs on whatever tokens this rank holds.

    Without expert parallelism the experts are replicated and the block runs on local
    tensors (``region_dispatch=False``: routing is data-dependent). With ``ep_size > 1``
    the routed experts are sharded ``Shard(0)`` on ``ep`` of the derived expert mesh and
    a compute (``local_compute_fn``, from hp-plugin-moe) does the all-to-all.
    """
    params: dict[str, dict] = {}
    stack: dict[str, list[str]] = {}
    for rel, role in ctx.block.params.items():
        if role is Role.MOE_EXPERT and ctx.ep_size > 1:
            head, sep, tail = rel.partition("experts.")
            rest = tail.split(".", 1)
            if sep and len(rest) == 2 and rest[0].isdigit():  # per-expert ModuleList layout
                stacked = f"{head}experts.{rest[1]}"
                stack.setdefault(stacked, []).append(rel)
                params[stacked] = {"ep": Shard(0)}
            else:
                params[rel] = {"ep": Shard(0)}
        else:
            layout = ctx.replicated()
            if layout:
                params[rel] = layout
    spec = ModuleShardingSpec(
        params=params,
        in_src=ctx.inputs_io(ctx.hidden),
        in_dst=ctx.inputs_io(ctx.hidden),
        out_src=ctx.io("output", ctx.hidden),
        out_dst=ctx.io("output", ctx.hidden),
        region_dispatch=False,
    )
    if ctx.ep_size > 1:
        spec.with_derived(
            ep_size=ctx.ep_size,
            ep_stack={k: sorted(v, key=_expert_index) for k, v in stack.items()},
        )
        # The expert-parallel compute an installed plugin registers for this architecture
        # (or this block's class); with none, preflight refuses and says what to install.
        for name in (*ctx.architectures, type(ctx.block.module).__name__):
            factory = suggest_compute_factory(name)
            if factory is not None:
                spec.local_compute_fn = factory  # a registry name, as an override writes it
                break
    return spec


def _expert_index(rel: str) -> int:
    tail = rel.partition("experts.")[2]
    return int(tail.split(".", 1)[0])


def layer(ctx: TemplateContext) -> ModuleShardingSpec | None:
    """Under sequence parallelism a decoder layer shards the residual stream at entry.

    Its children (norms, attention, MLP) are boundaries of their own; the layer itself
    only converts layouts, and runs its forward on local tensors.
    """
    if not ctx.sp_active:
        return None
    return ModuleShardingSpec(
        params={},
        in_src=ctx.inputs_io(ctx.embed_out if ctx.is_first_layer else ctx.hidden),
        in_dst=ctx.inputs_io(ctx.hidden),
        out_src=ctx.io("output", ctx.hidden),
        out_dst=ctx.io("output", ctx.hidden),
        region_dispatch=False,
    )


DEFAULT_BOUNDARY_TEMPLATES: tuple[BoundaryTemplate, ...] = (
    BoundaryTemplate("boundary.embed", "embed", embed),
    BoundaryTemplate("boundary.lm_head", "lm_head", lm_head),
    BoundaryTemplate("boundary.norm", "norm", norm),
    BoundaryTemplate("boundary.attention", "attention", attention),
    BoundaryTemplate("boundary.mlp", "mlp", mlp),
    BoundaryTemplate("boundary.moe", "moe", moe),
    BoundaryTemplate("boundary.layer", "layer", layer),
)
