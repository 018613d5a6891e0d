"""Dense decoder-only families of the differential matrix beyond the required and extra ones.

Attention + MLP families (no experts, no latent attention, no state-space layers) that the
census (:mod:`hp_core.testing.family_census`) found in the installed ``transformers``.
"""

from __future__ import annotations

from hp_core.testing.family_config import (
    TOKENS,
    WINDOW,
    Family,
    hd,
    llama_like,
)

__all__ = ["DENSE_FAMILIES"]

_SLIDING_FULL = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
_GRANITE = {
    "embedding_multiplier": 4.0,
    "logits_scaling": 2.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.25,
}

#: Dense decoder-only families.
DENSE_FAMILIES: tuple[Family, ...] = (
    Family(
        "apertus1p5_text",
        "apertus1p5_text",
        hd(),
        notes="xIELU MLP without a gate (learnable alpha_p/alpha_n), q/k norms",
    ),
    Family(
        "bitnet",
        "bitnet",
        hd(),
        notes="BitNet b1.58: RMSNorm inside attention (attn_sub_norm) and MLP (ffn_sub_norm) "
        "before the out projections",
    ),
    Family(
        "cohere_compass_text",
        "cohere_compass_text",
        llama_like(
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": None,
            },
            **_SLIDING_FULL,
        ),
        notes="cohere-style parallel attention + MLP off one LayerNorm, sliding layers with RoPE "
        "+ a full layer without (per-layer-type rope_parameters)",
    ),
    Family(
        "cpmant",
        "cpmant",
        {
            "vocab_size": 128,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "dim_head": 16,
            "dim_ff": 128,
            "num_hidden_layers": 2,
            "position_bias_num_buckets": 32,
            "position_bias_max_distance": 256,
            "prompt_types": 3,
            "prompt_length": 2,
            "segment_types": 3,
            "init_std": 0.02,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        attn_implementation="eager",
        notes="CPM-Ant: segment embedding, learned relative position bias shared by every layer, "
        "prompt tokens prepended (init_std 0.02: the default 1.0 gives loss 19)",
    ),
    Family("cwm", "cwm", hd(**_SLIDING_FULL), notes="llama-shaped with sliding + full layers"),
    Family(
        "diffllama",
        "diffllama",
        hd(),
        notes="differential attention: two softmax maps subtracted with learned lambda_q/k "
        "vectors, group norm over heads",
    ),
    Family(
        "doge",
        "doge",
        hd(hidden_dropout=0.0),
        notes="dynamic-mask attention, learned per-layer residual scales (input_residual, "
        "post_attention_residual); CDMoE off (is_moe=False)",
    ),
    Family(
        "dory",
        "dory",
        hd(
            n_input_layers=1,
            n_output_layers=0,
            n_recurrent_loops=2,
            **_SLIDING_FULL,
        ),
        notes="looped (recurrent-depth) decoder: an input layer, then a recurrent layer run twice, "
        "nGPT-style lambda residual scales",
    ),
    Family(
        "gemma3n_text",
        "gemma3n_text",
        hd(
            vocab_size_per_layer_input=128,
            hidden_size_per_layer_input=16,
            laurel_rank=8,
            num_kv_shared_layers=0,
            altup_num_inputs=2,
            activation_sparsity_pattern=[0.0, 0.0],
            **_SLIDING_FULL,
        ),
        notes="AltUp (2 streams), LAuReL low-rank residual, per-layer input embeddings, sliding + "
        "full layers",
    ),
    Family(
        "gemma4_text",
        "gemma4_text",
        hd(
            vocab_size_per_layer_input=128,
            hidden_size_per_layer_input=16,
            num_kv_shared_layers=0,
            global_head_dim=16,
            **_SLIDING_FULL,
        ),
        notes="per-layer input embeddings with a model-level projection, sliding + full layers, "
        "no kv sharing",
    ),
    Family(
        "gpt_neo",
        "gpt_neo",
        {
            "vocab_size": 128,
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "intermediate_size": 128,
            "max_position_embeddings": 256,
            "attention_types": [[["global", "local"], 1]],
            "window_size": WINDOW,
            "resid_dropout": 0.0,
            "embed_dropout": 0.0,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        attn_implementation="eager",
        notes="global + local (window 8) attention layers, learned positions, unscaled attention, "
        "eager only",
    ),
    Family(
        "granite_swa",
        "granite_swa",
        llama_like(**_GRANITE, **_SLIDING_FULL),
        attn_implementation="eager",
        notes="granite multipliers with sliding + full layers, eager only",
    ),
    Family(
        "hrm_text",
        "hrm_text",
        hd(H_cycles=2, L_cycles=1, prefix_lm=False),
        notes="hierarchical reasoning model: H and L layer stacks re-run over cycles, a frozen "
        "initial state z_L_init (requires_grad=False), causal (prefix_lm=False)",
    ),
    Family(
        "hyperclovax",
        "hyperclovax",
        llama_like(**_GRANITE, use_post_norm=True),
        notes="granite-style multipliers with post-sublayer norms (use_post_norm)",
    ),
    Family(
        "jais2",
        "jais2",
        llama_like(),
        notes="LayerNorm with bias, biases on every linear, up/down MLP without a gate",
    ),
    Family(
        "ministral3",
        "ministral3",
        hd(sliding_window=WINDOW),
        notes="mistral-shaped with sliding-window attention",
    ),
    Family(
        "modernbert-decoder",
        "modernbert-decoder",
        {
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 256,
            "local_attention": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "tie_word_embeddings": False,
            "cls_token_id": 1,
            "sep_token_id": 2,
            **TOKENS,
        },
        notes="ModernBERT layout as a causal decoder: embedding LayerNorm, fused Wqkv, GLU Wi/Wo "
        "MLP, local (window 8) + global layers",
    ),
    Family(
        "nanochat",
        "nanochat",
        hd(final_logit_softcapping=1.0),
        notes="no norm weights at all, bias-free fc1/fc2 MLP, final-logit softcapping",
    ),
    Family(
        "vaultgemma",
        "vaultgemma",
        hd(
            query_pre_attn_scalar=16,
            attn_logit_softcapping=0.1,
            final_logit_softcapping=1.0,
            **_SLIDING_FULL,
        ),
        attn_implementation="eager",
        notes="gemma2-shaped without post norms: attention and final-logit softcapping (eager), "
        "sliding + full layers",
    ),
    Family(
        "xglm",
        "xglm",
        {
            "vocab_size": 128,
            "d_model": 64,
            "ffn_dim": 128,
            "num_layers": 2,
            "attention_heads": 4,
            "max_position_embeddings": 256,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "activation_dropout": 0.0,
            "layerdrop": 0.0,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        attn_implementation="eager",
        notes="sinusoidal positions, scaled embedding, biases on every linear, fc1/fc2 MLP, eager "
        "only",
    ),
    Family(
        "ctrl",
        "ctrl",
        {
            "vocab_size": 128,
            "n_embd": 64,
            "dff": 128,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 256,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        notes="CTRL: sinusoidal positions, scaled embedding, attention called with one tensor as "
        "v, k and q",
    ),
    Family(
        "gemma4_unified_text",
        "gemma4_unified_text",
        hd(num_kv_shared_layers=0, global_head_dim=16, **_SLIDING_FULL),
        notes="q/k norms, pre+post norms, sliding + full layers, no kv sharing; compared in "
        "float64: in float32 its rounding alone exceeds the matrix's 1e-5 (measured: production "
        "1.01e-5, validate 9.4e-6 over rtol, both modes and one device agree in float64)",
        compare_dtype="float64",
    ),
    Family(
        "gpt_neox_japanese",
        "gpt_neox_japanese",
        {
            "vocab_size": 128,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_multiple_size": 2,
            "max_position_embeddings": 256,
            "attention_dropout": 0.0,
            "hidden_dropout": 0.0,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        attn_implementation="eager",
        notes="fused query_key_value, attention dense bias returned and added with the residual "
        "by the layer, eager only",
    ),
    Family(
        "openai-gpt",
        "openai-gpt",
        {
            "vocab_size": 128,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 256,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "summary_first_dropout": 0.0,
            "tie_word_embeddings": False,
            **TOKENS,
        },
        attn_implementation="eager",
        notes="GPT-1: post-LN blocks (LayerNorm after each residual add), Conv1D linears, fused "
        "c_attn, learned positions, eager only",
    ),
)
