"""Families of the differential matrix beyond the required ones."""

from __future__ import annotations

from hp_core.testing.family_config import (
    BASE,
    BOS_ID,
    EOS_ID,
    EXPERT_FFN,
    EXPERTS,
    TOKENS,
    TOP_K,
    WINDOW,
    Family,
    hd,
    llama_like,
)

__all__ = ["EXTRA_FAMILIES"]

#: Further families, beyond the required ones.
EXTRA_FAMILIES: tuple[Family, ...] = (
    Family(
        "olmo",
        "olmo",
        llama_like(clip_qkv=8.0),
        notes="non-parametric LayerNorm (no norm weights at all), q/k/v clamped (clip_qkv)",
    ),
    Family(
        "olmo3",
        "olmo3",
        llama_like(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
        notes="olmo2 layout (full-width q/k norms, post norms) with sliding + full layers",
    ),
    Family(
        "glm",
        "glm",
        hd(attention_bias=True),
        notes="partial rotary 0.5 (interleaved pairs), qkv bias, fused gate_up_proj",
    ),
    Family(
        "cohere2",
        "cohere2",
        llama_like(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
        notes="parallel attention + MLP off one bias-free LayerNorm, sliding layers with "
        "RoPE + a full layer without RoPE, logit_scale",
    ),
    Family(
        "granitemoe",
        "granitemoe",
        llama_like(
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            intermediate_size=EXPERT_FFN,
            embedding_multiplier=4.0,
            logits_scaling=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.25,
        ),
        notes="MoE in every layer (fused input_linear/output_linear experts) with granite "
        "multipliers",
    ),
    Family("helium", "helium", hd(), notes="llama-like (head_dim given explicitly)"),
    Family(
        "ernie4_5",
        "ernie4_5",
        {**BASE, "head_dim": 16, "use_bias": True},
        notes="biases on every linear, interleaved RoPE",
    ),
    Family("arcee", "arcee", hd(), notes="relu2 MLP without a gate (up_proj/down_proj)"),
    Family(
        "seed_oss",
        "seed_oss",
        hd(attention_bias=True, attention_out_bias=True, residual_dropout=0.0),
        notes="qkv bias and a separate o_proj bias switch",
    ),
    Family(
        "ministral",
        "ministral",
        hd(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
        notes="mistral with per-layer sliding/full attention types",
    ),
    Family(
        "exaone4",
        "exaone4",
        llama_like(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
        notes="q/k norms, post-sublayer norms only, sliding layers with RoPE + a full layer "
        "without",
    ),
    Family(
        "nemotron",
        "nemotron",
        hd(),
        notes="LayerNorm1P ((1 + weight), with bias), partial rotary 0.5, relu2 MLP without a gate",
    ),
    Family(
        "persimmon",
        "persimmon",
        {
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 256,
            "qk_layernorm": True,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        notes="fused query_key_value (per-head interleaved), per-head q/k LayerNorm, partial "
        "rotary 0.5, relu2 MLP, no GQA",
    ),
    Family(
        "gptj",
        "gptj",
        {
            "vocab_size": 128,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_inner": 128,
            "n_positions": 256,
            "rotary_dim": 8,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        notes="parallel attention + MLP off one LayerNorm, partial interleaved rotary "
        "(rotary_dim 8), bias-free q/k/v/out, lm_head bias, no GQA",
    ),
    Family(
        "codegen",
        "codegen",
        {
            "vocab_size": 128,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_inner": 128,
            "n_positions": 256,
            "n_ctx": 256,
            "rotary_dim": 8,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "tie_word_embeddings": False,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
        },
        notes="fused qkv_proj in mp_num=4 blocks (q, v, k order), parallel attention + MLP, "
        "partial interleaved rotary, lm_head bias, no GQA",
    ),
    Family(
        "bloom",
        "bloom",
        {
            "vocab_size": 128,
            "hidden_size": 64,
            "n_layer": 2,
            "n_head": 4,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        attn_implementation="eager",
        notes="ALiBi (no RoPE), fused query_key_value, embedding LayerNorm, MLP 4x hidden, "
        "eager attention only",
    ),
    Family(
        "opt",
        "opt",
        {
            "vocab_size": 128,
            "hidden_size": 64,
            "ffn_dim": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 256,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "layerdrop": 0.0,
            "word_embed_proj_dim": 64,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        notes="learned positions with offset 2, biases on every linear, relu fc1/fc2 MLP, no GQA",
    ),
    Family(
        "biogpt",
        "biogpt",
        {
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 256,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
            "activation_dropout": 0.0,
            "layerdrop": 0.0,
            "scale_embedding": True,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        notes="embedding scaled by sqrt(hidden), learned positions, biases everywhere, no GQA",
    ),
    Family(
        "dbrx",
        "dbrx",
        {
            "vocab_size": 128,
            "d_model": 64,
            "n_heads": 4,
            "n_layers": 2,
            "max_seq_len": 256,
            # rope_theta: DbrxAttention reads attn_config.rope_theta, which the
            # attention config no longer defines in transformers 5 (the rotary embedding
            # itself uses the top-level rope_parameters).
            "attn_config": {
                "kv_n_heads": 2,
                "attn_pdrop": 0.0,
                "clip_qkv": 8.0,
                "rope_theta": 10000.0,
            },
            "ffn_config": {
                "ffn_hidden_size": EXPERT_FFN,
                "moe_num_experts": EXPERTS,
                "moe_top_k": TOP_K,
            },
            "resid_pdrop": 0.0,
            "emb_pdrop": 0.0,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        notes="fused GQA Wqkv with clip_qkv, bias-free LayerNorms, MoE in every layer with "
        "experts stored as flat (experts * ffn, hidden) matrices",
    ),
    Family(
        "jetmoe",
        "jetmoe",
        {
            "vocab_size": 128,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "kv_channels": 16,
            "intermediate_size": EXPERT_FFN,
            "num_local_experts": EXPERTS,
            "num_experts_per_tok": TOP_K,
            "max_position_embeddings": 256,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        notes="mixture of attention heads (MoA: routed q/o experts, 4 heads = 2 kv heads x "
        "top-2) and MoE MLP in every layer",
    ),
    Family(
        "gpt_oss",
        "gpt_oss",
        hd(
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            intermediate_size=EXPERT_FFN,
            # shorter than family_batch's 16 tokens: the sliding layer's mask matters
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
        attn_implementation="eager",
        notes="attention sinks (eager only), qkv+o bias, yarn RoPE, MoE in every layer with "
        "a biased router, biased fused experts and clamped swiglu, sliding (window 6 < 16 "
        "tokens) + full layers",
    ),
    Family(
        "qwen3_next",
        "qwen3_next",
        hd(
            layer_types=["linear_attention", "full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_FFN,
            shared_expert_intermediate_size=EXPERT_FFN,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        notes="hybrid: gated DeltaNet linear attention (conv1d, torch fallback on CPU) + "
        "gated full attention with q/k norms, partial rotary 0.25, (1 + weight) norms, "
        "MoE with shared expert",
    ),
    Family(
        "apertus",
        "apertus",
        llama_like(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 12000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            }
        ),
        notes="xIELU MLP without a gate (learnable activation scalars alpha_p/alpha_n), "
        "q/k norms, llama3 RoPE",
    ),
    Family(
        "gpt_bigcode",
        "gpt_bigcode",
        {
            "vocab_size": 128,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_inner": 128,
            "n_positions": 256,
            "multi_query": True,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        notes="multi-query attention (one kv head) in a fused nn.Linear c_attn (q then k, v), "
        "learned positions, LayerNorm and biases on every linear, c_fc/c_proj gelu MLP",
    ),
    Family(
        "mpt",
        "mpt",
        {
            "vocab_size": 128,
            "d_model": 64,
            "n_heads": 4,
            "n_layers": 2,
            "max_seq_len": 256,
            "attn_config": {"clip_qkv": 8.0},  # attn_pdrop defaults to 0
            "resid_pdrop": 0.0,
            "emb_pdrop": 0.0,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        attn_implementation="eager",
        notes="ALiBi (no RoPE), fused Wqkv clamped (clip_qkv), bias-free linears and "
        "LayerNorms, MLP 4x hidden, eager attention only",
    ),
    Family(
        "hunyuan_v1_dense",
        "hunyuan_v1_dense",
        hd(),
        notes="q/k RMSNorm applied after RoPE (query_layernorm/key_layernorm)",
    ),
)
