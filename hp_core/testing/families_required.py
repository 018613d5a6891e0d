"""The required families of the differential matrix (one :class:`Family` row each)."""

from __future__ import annotations

from hp_core.testing.family_config import (
    BASE,
    EXPERT_FFN,
    EXPERTS,
    TOKENS,
    TOP_K,
    WINDOW,
    Family,
    hd,
    llama_like,
)

__all__ = ["REQUIRED_FAMILIES"]

#: The families the matrix must cover.
# # Where a family cannot take the common shape:
# * no GQA knob (every head has its own k/v): gpt2, gpt_neox, persimmon, gptj, codegen,
#   bloom, opt, biogpt; deepseek_v2/v3 use MLA (num_key_value_heads = 4, q/k head dim
#   16 + 8 rotary, v head dim 16, kv_lora_rank 32);
# * bloom's MLP is fixed at 4 x hidden (256); opt/biogpt learn 256 + 2 positions; bloom
#   (ALiBi) has no position limit;
# * qwen2_moe's shared expert is intermediate 128 (qwen3_next's: 32);
# * jetmoe's 4 attention heads are 2 kv heads x top-2 attention experts.
# Only gemma2 (softcapping), bloom, mpt (ALiBi) and gpt_oss (attention sinks) refuse sdpa:
# eager.
#
# Skipped families: none. Every requested extra (olmo, olmo3, glm, cohere2, granitemoe,
# helium, ernie4_5, arcee, seed_oss, ministral, exaone4, nemotron, persimmon, gptj, codegen,
# bloom, opt, biogpt, dbrx, jetmoe, gpt_oss, qwen3_next, apertus, gpt_bigcode, mpt,
# hunyuan_v1_dense) builds and trains on CPU in transformers 5.24; dbrx needs the
# attn_config workaround noted there.
# Every parameter of every family gets a gradient from the causal-LM loss.

REQUIRED_FAMILIES: tuple[Family, ...] = (
    Family(
        "llama", "llama", llama_like(), notes="reference decoder: GQA, RoPE, SwiGLU MLP, RMSNorm"
    ),
    Family(
        "mistral",
        "mistral",
        hd(sliding_window=WINDOW),
        notes="llama-like with sliding-window attention (window 8 < the 16-token batches)",
    ),
    Family(
        "qwen2",
        "qwen2",
        llama_like(use_sliding_window=False),
        notes="q/k/v projections with bias, o_proj without",
    ),
    Family(
        "qwen3",
        "qwen3",
        hd(use_sliding_window=False),
        notes="per-head RMSNorm on q and k (q_norm/k_norm), no qkv bias",
    ),
    Family(
        "qwen3_moe",
        "qwen3_moe",
        llama_like(
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_FFN,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            use_sliding_window=False,
        ),
        notes="MoE in every layer (fused expert weights), q/k norms, no shared expert",
    ),
    Family(
        "qwen2_moe",
        "qwen2_moe",
        llama_like(
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_FFN,
            shared_expert_intermediate_size=128,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
        ),
        notes="MoE in every layer plus a sigmoid-gated shared expert; qkv bias",
    ),
    Family(
        "mixtral",
        "mixtral",
        hd(
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            intermediate_size=EXPERT_FFN,
            sliding_window=None,
        ),
        notes="MoE in every layer, no dense MLP (experts use intermediate_size)",
    ),
    Family(
        "gemma",
        "gemma",
        hd(),
        notes="embedding scaled by sqrt(hidden), (1 + weight) RMSNorm, GeGLU MLP",
    ),
    Family(
        "gemma2",
        "gemma2",
        # Soft-caps small enough to bend these tiny weights' scores and logits (the
        # defaults, 50 and 30, are the identity to within 3e-4 here).
        hd(
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            attn_logit_softcapping=0.1,
            final_logit_softcapping=1.0,
        ),
        attn_implementation="eager",
        notes="attention and final-logit softcapping (sdpa refused), pre+post norms, "
        "alternating sliding/full layers, (1 + weight) norms, scaled embedding",
    ),
    Family(
        "gemma3",
        "gemma3_text",
        hd(
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),
        notes="q/k norms, pre+post norms, sliding + full layers with separate RoPE, "
        "(1 + weight) norms, scaled embedding",
    ),
    Family(
        "olmo2",
        "olmo2",
        llama_like(),
        notes="RMSNorm over the whole q and k projections, post-sublayer norms only",
    ),
    Family(
        "olmoe",
        "olmoe",
        llama_like(num_experts=EXPERTS, num_experts_per_tok=TOP_K, intermediate_size=EXPERT_FFN),
        notes="MoE in every layer, full-width q/k norms",
    ),
    Family(
        "deepseek_v2",
        "deepseek_v2",
        llama_like(
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            n_shared_experts=1,
            moe_intermediate_size=EXPERT_FFN,
            first_k_dense_replace=1,
            topk_method="greedy",
        ),
        notes="MLA with plain q_proj (V2-Lite style), compressed kv + decoupled RoPE "
        "(complex rotation); 1 dense + 1 MoE layer with a shared expert",
    ),
    Family(
        "deepseek_v3",
        "deepseek_v3",
        llama_like(
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
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
        ),
        notes="MLA with low-rank q and kv, interleaved RoPE; 1 dense + 1 MoE layer, "
        "sigmoid group-limited routing with e_score_correction_bias (a buffer)",
    ),
    Family(
        "gpt2",
        "gpt2",
        {
            "vocab_size": 128,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_inner": 128,
            "n_positions": 256,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "summary_first_dropout": 0.0,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        notes="Conv1D linears (weight is in x out), fused c_attn qkv, learned positions, no GQA",
    ),
    Family(
        "gpt_neox",
        "gpt_neox",
        {
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 256,
            "attention_dropout": 0.0,
            "hidden_dropout": 0.0,
            "classifier_dropout": 0.0,
            "use_parallel_residual": True,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        notes="fused query_key_value (per-head interleaved), partial rotary 0.25, "
        "parallel residual, LayerNorm with bias, no GQA",
    ),
    Family(
        "falcon",
        "falcon",
        {
            "vocab_size": 128,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_kv_heads": 2,
            "new_decoder_architecture": True,
            "ffn_hidden_size": 128,
            "max_position_embeddings": 256,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "bias": False,
            "alibi": False,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        notes="new decoder architecture: fused GQA query_key_value (grouped layout), "
        "parallel attention + MLP with two input LayerNorms",
    ),
    Family(
        "phi",
        "phi",
        llama_like(resid_pdrop=0.0, embd_pdrop=0.0),
        notes="parallel attention + MLP off one LayerNorm, partial rotary 0.5, biases "
        "everywhere (lm_head too), fc1/fc2 gelu MLP",
    ),
    Family(
        "phi3",
        "phi3",
        llama_like(
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            sliding_window=None,
            original_max_position_embeddings=256,
        ),
        notes="fused qkv_proj and fused gate_up_proj",
    ),
    Family(
        "glm4",
        "glm4",
        hd(attention_bias=True),
        notes="partial rotary 0.5 (interleaved pairs), qkv bias, fused gate_up_proj, "
        "sandwich (post-attention and post-MLP) norms",
    ),
    Family(
        "starcoder2",
        "starcoder2",
        {
            **BASE,
            "sliding_window": WINDOW,
            "attention_dropout": 0.0,
            "residual_dropout": 0.0,
            "embedding_dropout": 0.0,
            "use_bias": True,
        },
        notes="LayerNorm with bias, biases on every linear, c_fc/c_proj gelu MLP (no gate), "
        "sliding-window attention",
    ),
    Family(
        "cohere",
        "cohere",
        llama_like(use_qk_norm=True, logit_scale=0.5),
        notes="parallel attention + MLP off one bias-free LayerNorm, per-head q/k "
        "LayerNorm (weight heads x head_dim), logit_scale, interleaved RoPE",
    ),
    Family(
        "granite",
        "granite",
        llama_like(
            embedding_multiplier=4.0,
            logits_scaling=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.25,
        ),
        notes="llama-like with embedding/residual/attention multipliers and logit scaling",
    ),
    Family(
        "stablelm",
        "stablelm",
        llama_like(
            use_qkv_bias=True, qk_layernorm=False, use_parallel_residual=False, hidden_dropout=0.0
        ),
        notes="partial rotary 0.25, LayerNorm with bias, qkv bias",
    ),
    Family(
        "smollm3",
        "smollm3",
        llama_like(no_rope_layers=[1, 0], use_sliding_window=False),
        notes="NoPE: layer 1 skips RoPE (no_rope_layers=[1, 0])",
    ),
)
