"""Multi-head latent attention (MLA) and sparse-attention (indexer) families of the matrix.

MLA rows use the deepseek_v3 row's latent shape (4 kv heads = heads, q/k head dim 16 + 8
rotary, v head dim 16, kv and q lora rank 32; ``head_dim`` is the rotary part), with routed +
shared experts where the family has them. Sparse-attention indexers keep 8 of the 16 tokens
of a test batch, so their selection really drops keys. Part of
:data:`~hp_core.testing.families_moe.MOE_FAMILIES`.
"""

from __future__ import annotations

from typing import Any

from hp_core.testing.family_config import (
    EXPERT_FFN,
    EXPERTS,
    TOP_K,
    WINDOW,
    Family,
    hd,
    llama_like,
)

__all__ = ["DENSE_SPARSE", "MLA_FAMILIES"]

DENSE_SPARSE = ["dense", "sparse"]


def mla(**extra: Any) -> dict[str, Any]:
    """The deepseek-style MLA shape with routed + shared experts (deepseek spelling)."""
    shape: dict[str, Any] = dict(
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        n_shared_experts=1,
        moe_intermediate_size=EXPERT_FFN,
        n_group=1,
        topk_group=1,
    )
    return llama_like(**{**shape, "head_dim": 8, **extra})  # head_dim: the rotary part


#: Index selection of the sparse-attention (DSA) families: 8 of 16 tokens.
INDEXER = {"index_topk": 8, "index_head_dim": 16, "index_n_heads": 2}

MLA_FAMILIES: tuple[Family, ...] = (
    Family(
        "minicpm3",
        "minicpm3",
        llama_like(
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            head_dim=8,
            scale_emb=4,
            scale_depth=1.4,
            dim_model_base=32,
        ),
        notes="dense MLA (low-rank q and kv), scaled embeddings, depth-scaled residuals, "
        "logits divided by hidden/dim_model_base",
    ),
    Family(
        "youtu",
        "youtu",
        llama_like(
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            head_dim=8,
        ),
        notes="dense MLA with low-rank q and kv, interleaved RoPE",
    ),
    Family(
        "glm4_moe_lite",
        "glm4_moe_lite",
        mla(mlp_layer_types=DENSE_SPARSE),
        notes="MLA (low-rank q and kv, interleaved RoPE), dense then sigmoid MoE with a "
        "shared expert",
    ),
    Family(
        "sarvam_mla",
        "sarvam_mla",
        mla(q_lora_rank=None, first_k_dense_replace=1),
        notes="a deepseek_v3 model (DeepseekV3ForCausalLM): MLA with plain q_proj",
    ),
    Family(
        "deepseek_v32",
        "deepseek_v32",
        mla(mlp_layer_types=DENSE_SPARSE, **INDEXER),
        notes="MLA with the DSA lightning indexer (top-8 of 16 keys), dense then MoE",
    ),
    Family(
        "glm_moe_dsa",
        "glm_moe_dsa",
        mla(mlp_layer_types=DENSE_SPARSE, **INDEXER),
        notes="glm MLA with a DSA indexer (top-8 keys), dense then MoE",
    ),
    Family(
        "axk1",
        "axk1",
        mla(mlp_layer_types=DENSE_SPARSE),
        notes="deepseek_v3-like MLA, dense then group-routed MoE",
    ),
    Family(
        "axk2",
        "axk2",
        mla(mlp_layer_types=DENSE_SPARSE, gated_norm_rank=8, **INDEXER),
        notes="MLA with a DSA indexer and gated norms, dense then MoE",
    ),
    Family(
        "longcat_flash",
        "longcat_flash",
        {
            **llama_like(num_key_value_heads=4, head_dim=8),
            "num_layers": 2,
            "q_lora_rank": 32,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "ffn_hidden_size": 128,
            "n_routed_experts": EXPERTS,
            "moe_topk": TOP_K,
            "zero_expert_num": 2,
            "expert_ffn_hidden_size": EXPERT_FFN,
        },
        notes="shortcut-connected MoE: two MLA attentions and two dense MLPs per layer around "
        "one MoE with zero (identity) experts",
    ),
    Family(
        "dots3_note_text",
        "dots3_note_text",
        mla(mlp_layer_types=DENSE_SPARSE, shared_experts_intermediate_size=EXPERT_FFN, **INDEXER),
        notes="MLA with a DSA indexer, dense then MoE with a shared expert",
    ),
    Family(
        "hy_v4",
        "hy_v4",
        mla(mlp_layer_types=DENSE_SPARSE, hc_mult=2, **INDEXER),
        attn_implementation="eager",
        notes="MLA + DSA indexer, hyper-connections (hc_mult residual streams), attention sinks",
    ),
    Family(
        "deepseek_v4",
        "deepseek_v4",
        {
            **hd(num_key_value_heads=1, moe_intermediate_size=EXPERT_FFN),
            "q_lora_rank": 32,
            "n_routed_experts": EXPERTS,
            "num_experts_per_tok": TOP_K,
            "n_shared_experts": 1,
            "hc_mult": 2,
            "o_groups": 2,
            "o_lora_rank": 32,
            "sliding_window": WINDOW,
            "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
            "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            "num_nextn_predict_layers": 0,
            **INDEXER,
        },
        attn_implementation="eager",
        notes="compressed sparse attention with hyper-connections, grouped low-rank output",
    ),
    Family(
        "kolibri1_1",
        "kolibri1_1",
        hd(
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_FFN,
            shared_expert_intermediate_size=EXPERT_FFN,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "indexed_attention"],
            index_topk=8,
            index_pool_size=16,
            index_compression=2,
            index_num_heads=2,
            index_num_local_tokens=2,
            index_num_sink_tokens=1,
            mlp_only_layers=[0],
            mlp_only_intermediate_size=128,
        ),
        notes="kolibri1 with an indexed sparse attention layer (top-8 keys)",
    ),
    Family(
        "minimax_m3_vl_text",
        "minimax_m3_vl_text",
        hd(
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            intermediate_size=EXPERT_FFN,
            dense_intermediate_size=128,
            shared_intermediate_size=EXPERT_FFN,
            rotary_dim=8,
            mlp_layer_types=DENSE_SPARSE,
            index_n_heads=2,
            index_head_dim=16,
            index_block_size=4,
            index_topk_blocks=2,
        ),
        notes="block-sparse indexed attention, clamped swiglu, dense then MoE with a shared expert",
    ),
)
