"""The differential test matrix: :data:`FAMILIES_MATRIX`, tiny configs of many HF families.

Each :class:`Family` row names a Hugging Face ``model_type`` and the keyword arguments of
its tiny config (hidden 64, 4 attention heads, 2 key/value heads, head_dim 16, 2 layers,
vocabulary 128, intermediate 128, 256 positions, untied embeddings, fp32; MoE: 4 experts,
top-2, expert intermediate 32), spelt the way that family's config class spells them. The
builders that turn a row into a config, a model or a batch are in
:mod:`hp_core.testing.families`. Data only: importing this module imports no
``transformers``.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hp_core.errors import HpError

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "FAMILIES_MATRIX",
    "FAMILY_NAMES",
    "FIRST_ORDINARY_ID",
    "PAD_ID",
    "PER_LAYER_KEYS",
    "Family",
    "UnknownFamilyError",
]

#: Special token ids every family uses (inside the tiny vocabulary).
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
#: The first id :func:`family_batch` draws (ids below it are special tokens).
FIRST_ORDINARY_ID = 3


@dataclass(frozen=True)
class Family:
    """One tiny model family of the differential test matrix.

    ``config`` holds the keyword arguments given to ``AutoConfig.for_model(model_type, ...)``,
    spelt the way that family's config class spells them (its own names where it has an
    ``attribute_map``, such as GPT-2's ``n_embd``).
    """

    name: str
    model_type: str
    config: Mapping[str, Any] = field(default_factory=dict, hash=False)
    attn_implementation: str = "sdpa"
    notes: str = ""

    def __post_init__(self) -> None:
        # A read-only view: the table is shared by every caller.
        object.__setattr__(self, "config", types.MappingProxyType(dict(self.config)))

    @property
    def vocab_size(self) -> int:
        """The family's vocabulary size (every entry sets it)."""
        return int(self.config["vocab_size"])


class UnknownFamilyError(HpError, ValueError):
    """A model family name that is not in :data:`FAMILIES_MATRIX`."""


# ----------------------------------------------------------------------------- shared shapes

_TOKENS: dict[str, Any] = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}

#: Shape of a llama-like family (most of the table): the standard config names.
_BASE: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    **_TOKENS,
}

#: Config keys holding one entry per layer: tiled when ``num_hidden_layers`` is overridden.
PER_LAYER_KEYS = ("layer_types", "no_rope_layers")

#: A sliding window no shorter than any test sequence (families that need one set).
_WINDOW = 256

#: MoE shape: 4 experts, top-2, expert intermediate 32.
_EXPERTS, _TOP_K, _EXPERT_FFN = 4, 2, 32


def _llama_like(**extra: Any) -> dict[str, Any]:
    return {**_BASE, "attention_dropout": 0.0, **extra}


def _hd(**extra: Any) -> dict[str, Any]:
    """Llama-like with an explicit ``head_dim`` (families whose default is not hidden/heads)."""
    return _llama_like(head_dim=16, **extra)


# ----------------------------------------------------------------------------- the matrix
#
# Where a family cannot take the common shape:
# * no GQA knob (every head has its own k/v): gpt2, gpt_neox, persimmon, gptj, codegen,
#   bloom, opt, biogpt; deepseek_v2/v3 use MLA (num_key_value_heads = 4, q/k head dim
#   16 + 8 rotary, v head dim 16, kv_lora_rank 32);
# * bloom's MLP is fixed at 4 x hidden (256); opt/biogpt learn 256 + 2 positions; bloom
#   (ALiBi) has no position limit;
# * qwen2_moe's shared expert is intermediate 128 (qwen3_next's: 32);
# * jetmoe's 4 attention heads are 2 kv heads x top-2 attention experts.
# Only gemma2 (softcapping), bloom and gpt_oss (attention sinks) refuse sdpa: eager.
#
# Skipped families: none. Every requested extra (olmo, olmo3, glm, cohere2, granitemoe,
# helium, ernie4_5, arcee, seed_oss, ministral, exaone4, nemotron, persimmon, gptj, codegen,
# bloom, opt, biogpt, dbrx, jetmoe, gpt_oss, qwen3_next, apertus, hunyuan_v1_dense) builds
# and trains on CPU in transformers 5.24; dbrx needs the attn_config workaround noted there.
# Every parameter of every family gets a gradient from the causal-LM loss.

_FAMILIES: tuple[Family, ...] = (
    # --- the required 25 ---------------------------------------------------------------
    Family(
        "llama", "llama", _llama_like(), notes="reference decoder: GQA, RoPE, SwiGLU MLP, RMSNorm"
    ),
    Family(
        "mistral",
        "mistral",
        _hd(sliding_window=_WINDOW),
        notes="llama-like with sliding-window attention (window 256 >= sequence)",
    ),
    Family(
        "qwen2",
        "qwen2",
        _llama_like(use_sliding_window=False),
        notes="q/k/v projections with bias, o_proj without",
    ),
    Family(
        "qwen3",
        "qwen3",
        _hd(use_sliding_window=False),
        notes="per-head RMSNorm on q and k (q_norm/k_norm), no qkv bias",
    ),
    Family(
        "qwen3_moe",
        "qwen3_moe",
        _llama_like(
            num_experts=_EXPERTS,
            num_experts_per_tok=_TOP_K,
            moe_intermediate_size=_EXPERT_FFN,
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
        _llama_like(
            num_experts=_EXPERTS,
            num_experts_per_tok=_TOP_K,
            moe_intermediate_size=_EXPERT_FFN,
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
        _hd(
            num_local_experts=_EXPERTS,
            num_experts_per_tok=_TOP_K,
            intermediate_size=_EXPERT_FFN,
            sliding_window=None,
        ),
        notes="MoE in every layer, no dense MLP (experts use intermediate_size)",
    ),
    Family(
        "gemma",
        "gemma",
        _hd(),
        notes="embedding scaled by sqrt(hidden), (1 + weight) RMSNorm, GeGLU MLP",
    ),
    Family(
        "gemma2",
        "gemma2",
        _hd(query_pre_attn_scalar=16, sliding_window=_WINDOW),
        attn_implementation="eager",
        notes="attention and final-logit softcapping (sdpa refused), pre+post norms, "
        "alternating sliding/full layers, (1 + weight) norms, scaled embedding",
    ),
    Family(
        "gemma3",
        "gemma3_text",
        _hd(
            query_pre_attn_scalar=16,
            sliding_window=_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),
        notes="q/k norms, pre+post norms, sliding + full layers with separate RoPE, "
        "(1 + weight) norms, scaled embedding",
    ),
    Family(
        "olmo2",
        "olmo2",
        _llama_like(),
        notes="RMSNorm over the whole q and k projections, post-sublayer norms only",
    ),
    Family(
        "olmoe",
        "olmoe",
        _llama_like(
            num_experts=_EXPERTS, num_experts_per_tok=_TOP_K, intermediate_size=_EXPERT_FFN
        ),
        notes="MoE in every layer, full-width q/k norms",
    ),
    Family(
        "deepseek_v2",
        "deepseek_v2",
        _llama_like(
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=_EXPERTS,
            num_experts_per_tok=_TOP_K,
            n_shared_experts=1,
            moe_intermediate_size=_EXPERT_FFN,
            first_k_dense_replace=1,
            topk_method="greedy",
        ),
        notes="MLA with plain q_proj (V2-Lite style), compressed kv + decoupled RoPE "
        "(complex rotation); 1 dense + 1 MoE layer with a shared expert",
    ),
    Family(
        "deepseek_v3",
        "deepseek_v3",
        _llama_like(
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=_EXPERTS,
            num_experts_per_tok=_TOP_K,
            n_shared_experts=1,
            moe_intermediate_size=_EXPERT_FFN,
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
            **_TOKENS,
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
            **_TOKENS,
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
            **_TOKENS,
        },
        notes="new decoder architecture: fused GQA query_key_value (grouped layout), "
        "parallel attention + MLP with two input LayerNorms",
    ),
    Family(
        "phi",
        "phi",
        _llama_like(resid_pdrop=0.0, embd_pdrop=0.0),
        notes="parallel attention + MLP off one LayerNorm, partial rotary 0.5, biases "
        "everywhere (lm_head too), fc1/fc2 gelu MLP",
    ),
    Family(
        "phi3",
        "phi3",
        _llama_like(
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
        _hd(attention_bias=True),
        notes="partial rotary 0.5 (interleaved pairs), qkv bias, fused gate_up_proj, "
        "sandwich (post-attention and post-MLP) norms",
    ),
    Family(
        "starcoder2",
        "starcoder2",
        {
            **_BASE,
            "sliding_window": None,
            "attention_dropout": 0.0,
            "residual_dropout": 0.0,
            "embedding_dropout": 0.0,
            "use_bias": True,
        },
        notes="LayerNorm with bias, biases on every linear, c_fc/c_proj gelu MLP (no gate)",
    ),
    Family(
        "cohere",
        "cohere",
        _llama_like(use_qk_norm=True, logit_scale=0.5),
        notes="parallel attention + MLP off one bias-free LayerNorm, per-head q/k "
        "LayerNorm (weight heads x head_dim), logit_scale, interleaved RoPE",
    ),
    Family(
        "granite",
        "granite",
        _llama_like(
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
        _llama_like(
            use_qkv_bias=True, qk_layernorm=False, use_parallel_residual=False, hidden_dropout=0.0
        ),
        notes="partial rotary 0.25, LayerNorm with bias, qkv bias",
    ),
    Family(
        "smollm3",
        "smollm3",
        _llama_like(no_rope_layers=[1, 0], use_sliding_window=False),
        notes="NoPE: layer 1 skips RoPE (no_rope_layers=[1, 0])",
    ),
    # --- extras ------------------------------------------------------------------------
    Family(
        "olmo",
        "olmo",
        _llama_like(clip_qkv=8.0),
        notes="non-parametric LayerNorm (no norm weights at all), q/k/v clamped (clip_qkv)",
    ),
    Family(
        "olmo3",
        "olmo3",
        _llama_like(sliding_window=_WINDOW, layer_types=["sliding_attention", "full_attention"]),
        notes="olmo2 layout (full-width q/k norms, post norms) with sliding + full layers",
    ),
    Family(
        "glm",
        "glm",
        _hd(attention_bias=True),
        notes="partial rotary 0.5 (interleaved pairs), qkv bias, fused gate_up_proj",
    ),
    Family(
        "cohere2",
        "cohere2",
        _llama_like(sliding_window=_WINDOW, layer_types=["sliding_attention", "full_attention"]),
        notes="parallel attention + MLP off one bias-free LayerNorm, sliding layers with "
        "RoPE + a full layer without RoPE, logit_scale",
    ),
    Family(
        "granitemoe",
        "granitemoe",
        _llama_like(
            num_local_experts=_EXPERTS,
            num_experts_per_tok=_TOP_K,
            intermediate_size=_EXPERT_FFN,
            embedding_multiplier=4.0,
            logits_scaling=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.25,
        ),
        notes="MoE in every layer (fused input_linear/output_linear experts) with granite "
        "multipliers",
    ),
    Family("helium", "helium", _hd(), notes="llama-like (head_dim given explicitly)"),
    Family(
        "ernie4_5",
        "ernie4_5",
        {**_BASE, "head_dim": 16, "use_bias": True},
        notes="biases on every linear, interleaved RoPE",
    ),
    Family("arcee", "arcee", _hd(), notes="relu2 MLP without a gate (up_proj/down_proj)"),
    Family(
        "seed_oss",
        "seed_oss",
        _hd(attention_bias=True, attention_out_bias=True, residual_dropout=0.0),
        notes="qkv bias and a separate o_proj bias switch",
    ),
    Family(
        "ministral",
        "ministral",
        _hd(sliding_window=_WINDOW, layer_types=["sliding_attention", "full_attention"]),
        notes="mistral with per-layer sliding/full attention types",
    ),
    Family(
        "exaone4",
        "exaone4",
        _llama_like(sliding_window=_WINDOW, layer_types=["sliding_attention", "full_attention"]),
        notes="q/k norms, post-sublayer norms only, sliding layers with RoPE + a full layer "
        "without",
    ),
    Family(
        "nemotron",
        "nemotron",
        _hd(),
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
            **_TOKENS,
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
            **_TOKENS,
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
            **_TOKENS,
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
            **_TOKENS,
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
            **_TOKENS,
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
                "ffn_hidden_size": _EXPERT_FFN,
                "moe_num_experts": _EXPERTS,
                "moe_top_k": _TOP_K,
            },
            "resid_pdrop": 0.0,
            "emb_pdrop": 0.0,
            "tie_word_embeddings": False,
            **_TOKENS,
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
            "intermediate_size": _EXPERT_FFN,
            "num_local_experts": _EXPERTS,
            "num_experts_per_tok": _TOP_K,
            "max_position_embeddings": 256,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            **_TOKENS,
        },
        notes="mixture of attention heads (MoA: routed q/o experts, 4 heads = 2 kv heads x "
        "top-2) and MoE MLP in every layer",
    ),
    Family(
        "gpt_oss",
        "gpt_oss",
        _hd(
            num_local_experts=_EXPERTS,
            num_experts_per_tok=_TOP_K,
            intermediate_size=_EXPERT_FFN,
            sliding_window=_WINDOW,
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
        "a biased router, biased fused experts and clamped swiglu, sliding + full layers",
    ),
    Family(
        "qwen3_next",
        "qwen3_next",
        _hd(
            layer_types=["linear_attention", "full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=_EXPERTS,
            num_experts_per_tok=_TOP_K,
            moe_intermediate_size=_EXPERT_FFN,
            shared_expert_intermediate_size=_EXPERT_FFN,
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
        _llama_like(
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
        "hunyuan_v1_dense",
        "hunyuan_v1_dense",
        _hd(),
        notes="q/k RMSNorm applied after RoPE (query_layernorm/key_layernorm)",
    ),
)

#: Every family of the matrix, by name, in a stable order.
FAMILIES_MATRIX: dict[str, Family] = {f.name: f for f in _FAMILIES}
#: The family names, in the table's order.
FAMILY_NAMES: tuple[str, ...] = tuple(FAMILIES_MATRIX)
