"""Model presets: tiny and 7B-shaped Hugging Face causal-LM configs, by name.

The names ``hp plan --model llama`` and ``--model llama-7b`` take resolve here: the
CLI, ``hp demo``, the tests and plugin authors all build their models from these presets.

Every family shares one shape (hidden 64, 4 attention heads, 2 key/value heads, 2
layers, vocabulary 128, MLP intermediate 128; MoE: 4 experts, top-2, expert
intermediate 32), fp32 and SDPA attention, so a test can swap families without
re-deriving sizes. ``build_model`` seeds torch first: every rank that calls it with
the same seed builds identical weights, which is what a distributed test needs to
compare against a single-device run. ``*-7b`` presets give 7B-shaped configs for
planning on the meta device (nothing is downloaded; weights are never materialized
unless you build on a real device).

``transformers`` is imported lazily (an optional dependency, the ``hf`` extra), so
importing this module is cheap and works without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hp_core.errors import HpError
from hp_core.spec.keywords import close_matches

__all__ = [
    "FAMILIES",
    "PRESETS",
    "SEVEN_B",
    "UnknownModelPresetError",
    "build_model",
    "model_from_config",
    "preset_config",
    "tiny_config",
]

#: Tiny model families: name → (config class, causal-LM class) in ``transformers``.
_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}
#: The tiny families, in a stable order.
FAMILIES: tuple[str, ...] = tuple(_CLASSES)

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "dtype": "float32",
    "attn_implementation": "sdpa",
}
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "mistral": {"sliding_window": None},
    "qwen2moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 128,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    # Mixtral's experts use ``intermediate_size`` (there is no dense MLP), so it is the
    # expert intermediate size here.
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
}

#: 7B-shaped configs (for planning on the meta device): preset name → (family, config).
SEVEN_B: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-7b": (
        "llama",
        {
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
        },
    ),
    "mistral-7b": (
        "mistral",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 32000,
            "max_position_embeddings": 32768,
        },
    ),
    "qwen2-7b": (
        "qwen2",
        {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
            "max_position_embeddings": 32768,
        },
    ),
}
#: Every preset name :func:`preset_config` accepts.
PRESETS: tuple[str, ...] = (*FAMILIES, *SEVEN_B)


class UnknownModelPresetError(HpError, ValueError):
    """A model family or preset name that hp does not know."""


def _unknown(name: Any, valid: tuple[str, ...], what: str) -> UnknownModelPresetError:
    best = close_matches(str(name), valid, n=1)
    hint = f" Did you mean {best[0]!r}?" if best else ""
    return UnknownModelPresetError(f"unknown {what} {name!r}.{hint} Known: {', '.join(valid)}.")


def _transformers_class(name: str) -> Any:
    import transformers  # optional dependency (the hf extra): imported only when a model is built

    return getattr(transformers, name)


def _make_config(family: str, values: Mapping[str, Any]) -> Any:
    config_cls = _transformers_class(_CLASSES[family][0])
    values = dict(values)
    attn = values.pop("attn_implementation", None)
    cfg = config_cls(**values)
    if attn is not None:
        cfg._attn_implementation = attn
    return cfg


def tiny_config(family: str, **overrides: Any) -> Any:
    """The tiny HF config of ``family`` (one of :data:`FAMILIES`), with ``overrides`` applied.

    ``tiny_config("llama", attention_bias=True, mlp_bias=True)`` adds o_proj/down_proj
    biases; ``tiny_config("qwen2", tie_word_embeddings=True)`` ties the embeddings.
    """
    if family not in _CLASSES:
        raise _unknown(family, FAMILIES, "model family")
    values = {**_COMMON, **_FAMILY_DEFAULTS[family], **overrides}
    return _make_config(family, values)


def preset_config(name: str, **overrides: Any) -> Any:
    """The config of a preset: a tiny family (``"llama"``) or a 7B shape (``"llama-7b"``)."""
    if name in _CLASSES:
        return tiny_config(name, **overrides)
    if name in SEVEN_B:
        family, shape = SEVEN_B[name]
        values = {**_COMMON, **_FAMILY_DEFAULTS[family], **shape, **overrides}
        return _make_config(family, values)
    raise _unknown(name, PRESETS, "model preset")


def model_from_config(config: Any, *, device: str | torch.device = "meta") -> nn.Module:
    """A causal LM for ``config`` built on ``device`` (default meta: no memory, no init cost)."""
    from transformers import AutoModelForCausalLM  # optional dependency (the hf extra)

    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


def build_model(
    family: str, *, seed: int = 0, device: str | torch.device = "cpu", **config_overrides: Any
) -> nn.Module:
    """A tiny ``family`` causal LM with weights drawn after ``torch.manual_seed(seed)``.

    Calls with the same arguments build identical weights (in any process), so every rank
    of a distributed test and its single-device reference start from the same model.
    """
    cfg = tiny_config(family, **config_overrides)
    model_cls = _transformers_class(_CLASSES[family][1])
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(cfg)
    return model
