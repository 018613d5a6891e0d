"""The tiny configs of the matrix really exercise each family's distinctive features.

A differential test proves nothing about a feature its inputs never reach: a sliding window
longer than the batch is full attention, a soft-cap far above the logits is the identity.
These checks pin, on the 16-token batches the matrix trains on, that sliding windows drop
keys (and mixed layer patterns have both kinds of layer), Gemma scales its embedding and
norms by ``1 + weight``, Gemma-2's soft-caps bend its scores and logits, rotary embeddings
are partial where the family's are, and bias-carrying families carry non-zero biases.
In-process, on one device.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from hp_core.testing.families import build_family, family_batch, tiny_family_config
from hp_core.testing.family_config import WINDOW

SEQ = family_batch("llama").shape[1]
SLIDING = (
    "mistral",
    "gemma2",
    "gemma3",
    "cohere2",
    "gpt_oss",
    "ministral",
    "exaone4",
    "olmo3",
    "starcoder2",
)
MIXED = ("gemma2", "gemma3", "cohere2", "gpt_oss", "ministral", "exaone4", "olmo3")
GEMMA = ("gemma", "gemma2", "gemma3")
#: The rotary fraction of each family with partial rotary (of head_dim 16).
PARTIAL_ROTARY = {
    "gpt_neox": 0.25,
    "phi": 0.5,
    "glm4": 0.5,
    "stablelm": 0.25,
    "glm": 0.5,
    "nemotron": 0.5,
    "persimmon": 0.5,
    "qwen3_next": 0.25,
}
#: A bias of each family that has biases (every parameter is perturbed; these are non-zero).
BIASES = {
    "qwen2": "model.layers.0.self_attn.q_proj.bias",
    "qwen2_moe": "model.layers.0.self_attn.k_proj.bias",
    "starcoder2": "model.layers.0.mlp.c_fc.bias",
    "phi": "lm_head.bias",
    "glm4": "model.layers.0.self_attn.v_proj.bias",
    "stablelm": "model.layers.0.self_attn.q_proj.bias",
    "gpt_bigcode": "transformer.h.0.attn.c_attn.bias",
    "gpt_oss": "model.layers.0.mlp.router.bias",
    "ernie4_5": "model.layers.0.mlp.down_proj.bias",
    "opt": "model.decoder.layers.0.fc1.bias",
}


@functools.cache
def _logits(name: str, **overrides) -> torch.Tensor:
    model = build_family(name, **overrides)
    with torch.no_grad():
        return model(input_ids=family_batch(name), use_cache=False).logits


def _rel_change(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", SLIDING)
def test_sliding_windows_are_shorter_than_the_batch_and_drop_keys(name):
    cfg = tiny_family_config(name)
    assert cfg.sliding_window == WINDOW < SEQ
    windowed, full = _logits(name), _logits(name, sliding_window=SEQ)
    # The first WINDOW positions see every earlier key either way; the later ones do not.
    assert torch.allclose(windowed[:, :WINDOW], full[:, :WINDOW], atol=1e-6)
    assert (windowed[:, WINDOW:] - full[:, WINDOW:]).abs().max() > 1e-3


def test_a_window_as_long_as_the_batch_is_full_attention():
    """Negative control of the check above: a window of SEQ changes nothing."""
    assert torch.allclose(
        _logits("mistral", sliding_window=SEQ), _logits("mistral", sliding_window=4 * SEQ)
    )


@pytest.mark.parametrize("name", MIXED)
def test_mixed_layer_patterns_have_sliding_and_full_layers(name):
    types = tiny_family_config(name).layer_types
    assert set(types) == {"sliding_attention", "full_attention"}, types


@pytest.mark.parametrize("name", GEMMA)
def test_gemma_scales_its_embedding(name):
    model = build_family(name)
    ids = family_batch(name)
    seen = {}

    def record(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        seen["x"] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    model.model.layers[0].register_forward_pre_hook(record, with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    scale = model.config.hidden_size**0.5
    assert scale != 1.0
    torch.testing.assert_close(seen["x"], model.model.embed_tokens.weight[ids] * scale)


@pytest.mark.parametrize("name", GEMMA)
def test_gemma_norms_scale_by_one_plus_weight(name):
    norms = [
        (n, m)
        for n, m in build_family(name).named_modules()
        if type(m).__name__.endswith("RMSNorm")
    ]
    assert len(norms) >= 5, norms
    for n, norm in norms:
        w = norm.weight.detach()
        assert w.abs().min() > 0, n  # perturbed off Gemma's zero init
        xs = torch.randn(3, w.numel(), generator=torch.Generator().manual_seed(0))
        normed = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + norm.eps)
        with torch.no_grad():
            got = norm(xs)
        torch.testing.assert_close(got, normed * (1 + w), msg=n)
        assert not torch.allclose(got, normed * w), n


def test_gemma2_soft_caps_are_set_and_bend_the_values():
    cfg = tiny_family_config("gemma2")
    assert cfg.attn_logit_softcapping is not None and cfg.final_logit_softcapping is not None
    capped = _logits("gemma2")
    logits = _logits("gemma2", final_logit_softcapping=None)
    scores = _logits("gemma2", attn_logit_softcapping=None)
    assert capped.abs().max() < cfg.final_logit_softcapping
    assert _rel_change(capped, logits) > 0.05  # the final cap is far from the identity here
    assert _rel_change(capped, scores) > 1e-3  # so is the attention cap


def test_gemma2_default_soft_caps_would_be_the_identity():
    """Why the table sets small caps: the defaults (50, 30) hardly touch tiny values."""
    default = _logits("gemma2", attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    none = _logits("gemma2", attn_logit_softcapping=None, final_logit_softcapping=None)
    assert _rel_change(default, none) < 1e-3


@pytest.mark.parametrize(("name", "fraction"), PARTIAL_ROTARY.items())
def test_partial_rotary(name, fraction):
    assert tiny_family_config(name).rope_parameters["partial_rotary_factor"] == fraction < 1


@pytest.mark.parametrize("name", ["gptj", "codegen"])
def test_partial_interleaved_rotary_dim(name):
    cfg = tiny_family_config(name)
    assert cfg.rotary_dim < cfg.n_embd // cfg.n_head


@pytest.mark.parametrize(("name", "bias"), BIASES.items())
def test_biases_are_non_zero(name, bias):
    param: nn.Parameter = build_family(name).get_parameter(bias)
    assert param.abs().min() > 0, f"{name}: {bias} has zero entries"
