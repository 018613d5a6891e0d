"""Role rules, boundary templates and the ALiBi wrapper for ``BloomForCausalLM``.

What BLOOM needs that the core's defaults do not give it:

* **roles**: ``self_attention.query_key_value`` packs q, k and v *per head* (its rows are
  ``heads x (q, k, v) x head_dim``), so a contiguous row shard already gives each rank
  whole heads: it is an ordinary column-parallel projection, not a fused one that needs
  de-interleaving. ``dense_h_to_4h`` is column-parallel; ``dense`` and ``dense_4h_to_h``
  are row-parallel exits.
* **residuals inside the modules**: ``BloomAttention`` and ``BloomMLP`` add the residual
  stream to their row-parallel output themselves. That output is a partial sum on tp, so
  the residual must join it once, not on every rank; DTensor cannot redistribute an input
  *to* a partial sum, so the templates declare the residual whole on tp (like the hidden
  state) and the blocks' inner wrappers add it on tp rank 0 only
  (:mod:`hp_plugin_bloom.local_region`).
* **the ALiBi bias**: built once for all heads and shared by every attention; the
  attention's wrapper :func:`~hp_plugin_bloom.alibi.bloom_alibi_heads` hands each rank its
  own heads' rows.
* **the embedding LayerNorm** runs between the embedding and the first layer, where the
  hidden state is still whole on tp, so it keeps the embedding's output layout.

Everything is scoped to ``BloomForCausalLM``: scoped rules and templates take precedence
over the core's defaults, and no other architecture sees them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.tensor import Shard

from hp_core import BoundaryTemplate, ModuleShardingSpec, Role, RoleRule
from hp_core.hookspecs import hookimpl
from hp_plugin_bloom.alibi import ALIBI_WRAPPER, bloom_alibi_heads
from hp_plugin_bloom.local_region import RESIDUAL_WRAPPER, bloom_residual_once

__all__ = [
    "ARCHITECTURE",
    "BLOOM_ROLE_RULES",
    "BLOOM_TEMPLATES",
    "HP_PLUGIN_API",
    "hp_register_inner_wrappers",
    "hp_register_templates",
]

#: The hp plugin API (hook specs + injection signatures) this plugin is built for: a
#: literal, so an hp-core speaking another version refuses it instead of misusing it.
HP_PLUGIN_API = 2

ARCHITECTURE = "BloomForCausalLM"
_SCOPE = (ARCHITECTURE,)


def _rule(name: str, pattern: str, role: Role) -> RoleRule:
    return RoleRule(f"bloom.{name}", pattern, role, _SCOPE)


BLOOM_ROLE_RULES: tuple[RoleRule, ...] = (
    _rule("qkv", r"(^|\.)self_attention\.query_key_value\.(weight|bias)$", Role.COLWISE),
    _rule("attn_out", r"(^|\.)self_attention\.dense\.(weight|bias)$", Role.ROWWISE),
    _rule("mlp_in", r"(^|\.)mlp\.dense_h_to_4h\.(weight|bias)$", Role.COLWISE),
    _rule("mlp_out", r"(^|\.)mlp\.dense_4h_to_h\.(weight|bias)$", Role.ROWWISE),
    _rule(
        "norms",
        r"(^|\.)(input_layernorm|post_attention_layernorm|ln_f|word_embeddings_layernorm)"
        r"\.(weight|bias)$",
        Role.NORM,
    ),
)


def _params(ctx: Any) -> dict[str, dict]:
    """Column-parallel rows and row-parallel columns on tp; everything else replicated."""
    out: dict[str, dict] = {}
    for rel, role in ctx.block.params.items():
        if role is Role.COLWISE:
            out[rel] = ctx.tp_param(Shard(0))
        elif role is Role.ROWWISE and rel.endswith("weight"):
            out[rel] = ctx.tp_param(Shard(1))
        else:  # row-parallel biases: the core adds them once, after the exit's reduction
            out[rel] = ctx.replicated()
    return {k: v for k, v in out.items() if v}


def _with_residual(ctx: Any, wrapper: str, **extra: Any) -> ModuleShardingSpec:
    """``forward(hidden_states, residual)``: both gathered on tp, the output a partial sum,
    run by ``wrapper`` on local shards (plain torch ops: ``region_dispatch=True``)."""
    inputs = ("hidden_states", "residual")
    return ModuleShardingSpec(
        params=_params(ctx),
        in_src={k: v for name in inputs for k, v in ctx.io(name, ctx.hidden).items()},
        in_dst={k: v for name in inputs for k, v in ctx.io(name, ctx.gathered).items()},
        out_src=ctx.io("output", ctx.partial if ctx.has_tp else ctx.gathered),
        out_dst=ctx.io("output", ctx.hidden),
        inner_target="self",
        inner_wrapper=wrapper,
        region_dispatch=True,
        **extra,
    )


def attention(ctx: Any) -> ModuleShardingSpec:
    """``BloomAttention``: heads sharded on tp, each rank's ALiBi rows picked by the wrapper."""
    return _with_residual(ctx, ALIBI_WRAPPER, out_names=["output", "attn_weights"])


def mlp(ctx: Any) -> ModuleShardingSpec:
    """``BloomMLP``: column- then row-parallel, the residual added to the partial sum."""
    return _with_residual(ctx, RESIDUAL_WRAPPER)


def norm(ctx: Any) -> ModuleShardingSpec:
    """A LayerNorm: the hidden layout, except the embedding's, which sees the embedding output."""
    layout = ctx.embed_out if ctx.fqn.endswith("word_embeddings_layernorm") else ctx.hidden
    x = ctx.first_input()
    return ModuleShardingSpec(
        params={rel: ctx.replicated() for rel in ctx.block.params if ctx.replicated()},
        in_src=ctx.io(x, layout),
        in_dst=ctx.io(x, layout),
        out_src=ctx.io("output", layout),
        out_dst=ctx.io("output", layout),
    )


BLOOM_TEMPLATES: tuple[BoundaryTemplate, ...] = (
    BoundaryTemplate("bloom.attention", "attention", attention, _SCOPE),
    BoundaryTemplate("bloom.mlp", "mlp", mlp, _SCOPE),
    BoundaryTemplate("bloom.norm", "norm", norm, _SCOPE),
)


@hookimpl
def hp_register_templates(register: Callable[[Any], None]) -> None:
    """Register the BLOOM role rules and boundary templates."""
    for item in (*BLOOM_ROLE_RULES, *BLOOM_TEMPLATES):
        register(item)


@hookimpl
def hp_register_inner_wrappers(register: Callable[..., None]) -> None:
    """Register the attention's and the MLP's wrappers (plain torch ops on local shards)."""
    register(ALIBI_WRAPPER, bloom_alibi_heads, region_dispatch=True)
    register(RESIDUAL_WRAPPER, bloom_residual_once, region_dispatch=True)
