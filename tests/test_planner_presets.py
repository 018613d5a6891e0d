"""``hp_core.presets``: the tiny presets every planner test (and plugin author) builds on."""

from __future__ import annotations

import pytest
import torch

import hp_core.testing as testing
from hp_core.presets import (
    FAMILIES,
    PRESETS,
    SEVEN_B,
    UnknownModelPresetError,
    build_model,
    model_from_config,
    preset_config,
    tiny_config,
)


def test_families_and_public_exports():
    assert FAMILIES == ("llama", "qwen2", "mistral", "qwen2moe", "mixtral")
    assert PRESETS == (*FAMILIES, "llama-7b", "mistral-7b", "qwen2-7b")
    assert testing.build_model is build_model and testing.tiny_config is tiny_config


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_config_shape(family):
    cfg = tiny_config(family)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 4, 2)
    assert (cfg.num_hidden_layers, cfg.vocab_size) == (2, 128)
    assert cfg.tie_word_embeddings is False
    assert cfg._attn_implementation == "sdpa"
    assert cfg.dtype == torch.float32
    if family == "qwen2moe":
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
        assert cfg.intermediate_size == 128
    elif family == "mixtral":
        assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (4, 2, 32)
    else:
        assert cfg.intermediate_size == 128


def test_overrides_apply():
    cfg = tiny_config(
        "llama",
        attention_bias=True,
        mlp_bias=True,
        num_hidden_layers=3,
        attn_implementation="eager",
    )
    assert (cfg.attention_bias, cfg.mlp_bias, cfg.num_hidden_layers, cfg._attn_implementation) == (
        True,
        True,
        3,
        "eager",
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_build_model_is_seeded_and_runs(family):
    a = build_model(family, seed=3)
    b = build_model(family, seed=3)
    c = build_model(family, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(
        not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point() and sa[k].numel() > 1
    )
    assert all(p.dtype == torch.float32 for p in a.parameters())
    ids = torch.randint(0, 128, (1, 8))
    out = a(input_ids=ids, labels=ids)
    assert out.logits.shape == (1, 8, 128) and torch.isfinite(out.loss)


def test_build_model_on_meta_and_cpu():
    m = build_model("qwen2moe", device="meta")
    assert {p.device.type for p in m.parameters()} == {"meta"}
    assert type(m).__name__ == "Qwen2MoeForCausalLM"
    assert m.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 64, 64)
    assert build_model("mixtral", device="meta").model.layers[0].mlp.experts.down_proj.shape == (
        4,
        64,
        32,
    )
    tied = build_model("llama", device="meta", tie_word_embeddings=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_seven_b_presets():
    cfg = preset_config("llama-7b")
    assert (
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.vocab_size,
        cfg.intermediate_size,
    ) == (
        4096,
        32,
        32,
        32000,
        11008,
    )
    assert preset_config("mistral-7b").num_key_value_heads == 8
    assert preset_config("qwen2-7b", num_hidden_layers=1).num_hidden_layers == 1
    assert set(SEVEN_B) == {"llama-7b", "mistral-7b", "qwen2-7b"}
    assert preset_config("qwen2").hidden_size == 64
    model = model_from_config(preset_config("llama-7b"))
    assert model.lm_head.weight.device.type == "meta"
    assert model.lm_head.weight.shape == (32000, 4096)


def test_unknown_names():
    with pytest.raises(
        UnknownModelPresetError,
        match=r"unknown model family 'lama'\. Did you mean 'llama'\? Known: llama, qwen2",
    ):
        tiny_config("lama")
    with pytest.raises(UnknownModelPresetError, match=r"unknown model family 'gpt2'\. Known:"):
        build_model("gpt2")
    with pytest.raises(
        UnknownModelPresetError,
        match=r"unknown model preset 'llama-7B'\. Did you mean 'llama-7b'\?",
    ):
        preset_config("llama-7B")
