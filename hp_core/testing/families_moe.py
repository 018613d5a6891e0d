"""Mixture-of-experts and multi-head latent attention (MLA) families of the differential matrix.

Each row keeps the shared tiny shape of :mod:`~hp_core.testing.family_config` (hidden 64,
4 heads, 2 kv heads, head_dim 16, 2 layers, vocabulary 128; 4 experts, top-2, expert
intermediate 32). Where a family mixes dense and MoE layers, or sliding and full attention,
the 2 layers hold one of each. MLA rows use the deepseek_v3 row's latent shape (4 kv heads =
heads, q/k head dim 16 + 8 rotary, v head dim 16, kv and q lora rank 32); they and the
sparse-attention (indexer) rows are in :mod:`~hp_core.testing.families_mla`, and
:data:`MOE_FAMILIES` includes them.
"""

from __future__ import annotations

from typing import Any

from hp_core.testing.families_mla import DENSE_SPARSE, MLA_FAMILIES
from hp_core.testing.family_config import EXPERT_FFN, EXPERTS, TOP_K, WINDOW, Family, hd

__all__ = ["MOE_FAMILIES"]

SLIDE_FULL = ["sliding_attention", "full_attention"]


def moe(**extra: Any) -> dict[str, Any]:
    """The shared shape with ``head_dim`` and the usual MoE names (qwen/mixtral spelling)."""
    return hd(
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_FFN, **extra
    )


MOE_FAMILIES: tuple[Family, ...] = (
    *MLA_FAMILIES,
    Family(
        "llama4_text",
        "llama4_text",
        hd(
            intermediate_size=EXPERT_FFN,
            intermediate_size_mlp=128,
            num_local_experts=EXPERTS,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            no_rope_layers=[1, 0],
            attention_chunk_size=WINDOW,
        ),
        notes="chunked local attention with RoPE + a global NoPE layer with temperature "
        "tuning, q/k L2 norm, a dense layer and a top-1 sigmoid MoE layer with a shared expert",
    ),
    Family(
        "afmoe",
        "afmoe",
        moe(
            num_dense_layers=1,
            num_shared_experts=1,
            sliding_window=WINDOW,
            layer_types=SLIDE_FULL,
            route_scale=1.5,
        ),
        notes="sliding + full attention with gated output and q/k norms, one dense layer then "
        "MoE with a shared expert",
    ),
    Family(
        "aria_text",
        "aria_text",
        hd(
            intermediate_size=EXPERT_FFN,
            moe_num_experts=EXPERTS,
            moe_topk=TOP_K,
            moe_num_shared_experts=1,
        ),
        notes="llama attention, MoE in every layer with grouped-GEMM experts and shared experts",
    ),
    Family(
        "cohere2_moe",
        "cohere2_moe",
        hd(
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_FFN,
            num_shared_experts=1,
            sliding_window=WINDOW,
            layer_types=SLIDE_FULL,
            mlp_layer_types=DENSE_SPARSE,
            prefix_dense_intermediate_size=128,
        ),
        notes="cohere2 parallel block (sliding RoPE + full NoPE) with a dense then MoE layer "
        "and a shared expert",
    ),
    Family(
        "dots1",
        "dots1",
        hd(
            n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            n_shared_experts=1,
            moe_intermediate_size=EXPERT_FFN,
            first_k_dense_replace=1,
            sliding_window=WINDOW,
            layer_types=SLIDE_FULL,
        ),
        notes="q/k norms, one dense then one MoE layer (sigmoid group routing with a "
        "correction bias, shared expert)",
    ),
    Family(
        "ernie4_5_moe",
        "ernie4_5_moe",
        hd(
            moe_num_experts=EXPERTS,
            moe_k=TOP_K,
            moe_intermediate_size=EXPERT_FFN,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            use_bias=True,
        ),
        notes="biased linears, interleaved RoPE, a dense then a MoE layer with a shared expert "
        "and a correction bias",
    ),
    Family(
        "exaone_moe",
        "exaone_moe",
        moe(
            num_shared_experts=1,
            first_k_dense_replace=1,
            sliding_window=WINDOW,
            layer_types=SLIDE_FULL,
            mlp_layer_types=DENSE_SPARSE,
        ),
        notes="exaone4 attention (q/k norms, sliding RoPE + full NoPE), dense then sigmoid MoE",
    ),
    Family(
        "flex_olmo",
        "flex_olmo",
        hd(num_experts=EXPERTS, num_experts_per_tok=TOP_K, intermediate_size=EXPERT_FFN),
        notes="olmo2 layout (full-width q/k norms, post norms) with MoE in every layer",
    ),
    Family(
        "glm4_moe",
        "glm4_moe",
        hd(
            n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            n_shared_experts=1,
            moe_intermediate_size=EXPERT_FFN,
            first_k_dense_replace=1,
            use_qk_norm=True,
            attention_bias=True,
            num_mtp_layers=0,
        ),
        notes="partial rotary 0.5, qkv bias, q/k norms, dense then sigmoid group-routed MoE "
        "with a shared expert",
    ),
    Family(
        "granitemoeshared",
        "granitemoeshared",
        hd(
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            intermediate_size=EXPERT_FFN,
            shared_intermediate_size=64,
            embedding_multiplier=4.0,
            logits_scaling=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.25,
        ),
        notes="granitemoe with a shared expert and granite multipliers",
    ),
    Family(
        "granitemoe_swa",
        "granitemoe_swa",
        hd(
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            intermediate_size=EXPERT_FFN,
            shared_intermediate_size=64,
            sliding_window=WINDOW,
            layer_types=SLIDE_FULL,
            embedding_multiplier=4.0,
            logits_scaling=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.25,
        ),
        attn_implementation="eager",
        notes="granitemoeshared with sliding + full attention layers",
    ),
    Family(
        "hunyuan_v1_moe",
        "hunyuan_v1_moe",
        hd(num_experts=EXPERTS, moe_topk=TOP_K, intermediate_size=EXPERT_FFN),
        notes="q/k norms after RoPE, MoE in every layer with a shared MLP",
    ),
    Family(
        "hy_v3",
        "hy_v3",
        moe(num_shared_experts=1, mlp_layer_types=DENSE_SPARSE),
        notes="dense then sigmoid MoE with a shared expert and fp32 combine",
    ),
    Family(
        "phimoe",
        "phimoe",
        hd(
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            intermediate_size=EXPERT_FFN,
            router_jitter_noise=0.0,
            attention_bias=True,
            lm_head_bias=True,
        ),
        notes="LayerNorms, qkv bias, sparsemixer top-2 routing, lm_head bias",
    ),
    Family(
        "minimax_m2",
        "minimax_m2",
        hd(num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, intermediate_size=EXPERT_FFN),
        notes="full-width q/k norms, partial rotary, sigmoid routing with a correction bias",
    ),
    Family(
        "minimax",
        "minimax",
        hd(
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            intermediate_size=EXPERT_FFN,
            layer_types=["linear_attention", "full_attention"],
            block_size=8,
            full_attn_alpha_factor=0.5,
            linear_attn_alpha_factor=0.5,
            mlp_alpha_factor=0.5,
        ),
        notes="hybrid: lightning linear attention (block-wise decay) + full attention, "
        "residual alpha/beta factors, MoE in every layer",
    ),
    Family(
        "mimo_v2_flash",
        "mimo_v2_flash",
        hd(
            n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_FFN,
            v_head_dim=8,
            sliding_window=WINDOW,
            layer_types=SLIDE_FULL,
            mlp_layer_types=DENSE_SPARSE,
        ),
        attn_implementation="eager",
        notes="sliding + full attention with v head dim != qk head dim, dense then sigmoid MoE",
    ),
    Family(
        "minicpm5_moe",
        "minicpm5_moe",
        hd(
            n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            n_shared_experts=1,
            moe_intermediate_size=EXPERT_FFN,
            mlp_layer_types=DENSE_SPARSE,
        ),
        notes="dense then sigmoid group-routed MoE with a shared expert",
    ),
    Family(
        "solar_open",
        "solar_open",
        hd(
            n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            n_shared_experts=1,
            moe_intermediate_size=EXPERT_FFN,
        ),
        notes="sigmoid group-routed MoE in every layer with a shared expert",
    ),
    Family(
        "laguna",
        "laguna",
        moe(
            shared_expert_intermediate_size=EXPERT_FFN,
            sliding_window=WINDOW,
            layer_types=SLIDE_FULL,
            mlp_layer_types=DENSE_SPARSE,
        ),
        notes="gated attention, sliding + full layers, dense then MoE with a shared expert",
    ),
    Family(
        "mellum",
        "mellum",
        moe(sliding_window=WINDOW, layer_types=SLIDE_FULL, mlp_layer_types=DENSE_SPARSE),
        notes="sliding + full attention, dense then MoE",
    ),
    Family(
        "flint",
        "flint",
        moe(
            shared_expert_intermediate_size=EXPERT_FFN,
            sliding_window=WINDOW,
            layer_types=SLIDE_FULL,
            mlp_only_layers=[0],  # the default keeps the first two layers dense
        ),
        attn_implementation="eager",
        notes="sliding + full attention, a dense then a MoE layer with a shared expert",
    ),
    Family(
        "kolibri1",
        "kolibri1",
        moe(
            shared_expert_intermediate_size=EXPERT_FFN,
            sliding_window=WINDOW,
            layer_types=SLIDE_FULL,
        ),
        notes="sliding + full attention, MoE with a shared expert in every layer",
    ),
    Family(
        "ergo",
        "ergo",
        moe(
            first_dense_intermediate_size=128,
            shared_intermediate_size=EXPERT_FFN,
            sliding_window=WINDOW,
            layer_types=SLIDE_FULL,
            mlp_layer_types=DENSE_SPARSE,
        ),
        notes="local + global attention, a dense then a MoE layer with a shared expert",
    ),
    Family(
        "param2moe",
        "param2moe",
        hd(
            n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            n_shared_experts=1,
            moe_intermediate_size=EXPERT_FFN,
            first_k_dense_replace=1,
        ),
        notes="a glm4_moe model (Glm4MoeForCausalLM) with q/k norms",
    ),
    Family(
        "sarvam_moe",
        "sarvam_moe",
        hd(
            n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            n_shared_experts=1,
            moe_intermediate_size=EXPERT_FFN,
            first_k_dense_replace=1,
        ),
        notes="a glm4_moe model (Glm4MoeForCausalLM) with q/k norms",
    ),
    Family(
        "inkling_text",
        "inkling_text",
        hd(
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            swa_head_dim=16,
            sliding_window_size=WINDOW,
            d_rel=4,
            rel_extent=32,
            layer_types=["hybrid_sliding", "hybrid"],
            mlp_layer_types=DENSE_SPARSE,
            moe_intermediate_size=EXPERT_FFN,
            n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            n_shared_experts=1,
            logits_mup_width_multiplier=2.0,
        ),
        notes="attention with short convolutions on q/k/v, relative-position bias, sliding "
        "+ full layers, dense then MoE with a shared expert and sink",
    ),
    Family(
        "inkling2_text",
        "inkling2_text",
        hd(
            unpadded_vocab_size=128,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            swa_head_dim=16,
            sliding_window_size=WINDOW,
            d_rel=4,
            rel_extent=32,
            moe_intermediate_size=EXPERT_FFN,
            n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            n_layers_per_attn_res_block=1,
        ),
        attn_implementation="eager",
        notes="inkling attention (short convs, relative bias), attention residual blocks, "
        "soft-capped MLP and logits, sigmoid MoE",
    ),
    Family(
        "inkling2_loop_text",
        "inkling2_loop_text",
        hd(
            num_hidden_layers=3,
            unpadded_vocab_size=128,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            swa_head_dim=16,
            sliding_window_size=WINDOW,
            d_rel=4,
            rel_extent=32,
            moe_intermediate_size=EXPERT_FFN,
            n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            n_layers_per_attn_res_block=1,
            loop_layer_index_start=1,
            loop_layer_index_end=2,
            loop_num_passes=2,
            loop_gate_rank=8,
        ),
        attn_implementation="eager",
        notes="inkling2 with a looped middle layer (2 passes, low-rank loop gate)",
    ),
    Family(
        "beam",
        "beam",
        moe(
            n_group=2,
            topk_group=1,
            sliding_window=WINDOW,
            layer_types=SLIDE_FULL,
            mlp_layer_types=["dense", "sparse"],
        ),
        notes="sliding attention with RoPE + a full NoPE layer, gated output and q/k norms, "
        "a dense layer then group-routed MoE, soft-capped logits",
    ),
)
