"""Tiny configurations of many Hugging Face causal-LM families, for differential tests.

A differential test checks that a sharded model computes what a single-device run of the
*same* model computes: same loss, same logits, same gradients. That only means something
when the model is a real architecture (fused qkv, multi-head latent attention, q/k norms,
partial rotary, ``Conv1D`` linears, parallel attention, scaled embeddings, mixtures of
experts, ...) and when every weight is non-trivial. A freshly initialised HF model is not:
biases start at zero, norms at one (or at zero for Gemma-style ``1 + weight`` norms), so a
bug that drops or double-counts a bias or a norm weight goes unseen.

The table of tiny configs, :data:`~hp_core.testing.family_matrix.FAMILIES_MATRIX`, is in
:mod:`hp_core.testing.family_matrix`; this module builds from it:

* :func:`tiny_family_config` — the HF config of a family, with overrides;
* :func:`build_family` — the causal LM built after ``torch.manual_seed(seed)``, then every
  floating-point parameter shifted by ``perturb * randn`` drawn from a generator seeded
  with ``seed``. The same arguments give bit-identical weights in any process, so every
  rank of a distributed test can build its own copy of the reference model;
* :func:`family_batch` — deterministic input ids that avoid the special tokens.

``transformers`` is imported lazily (inside the functions), so importing this module is
cheap.
"""

from __future__ import annotations

import copy
import difflib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hp_core.testing.family_matrix import (
    FAMILIES_MATRIX,
    FAMILY_NAMES,
    FIRST_ORDINARY_ID,
    PER_LAYER_KEYS,
    Family,
    UnknownFamilyError,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "build_family",
    "family_batch",
    "family_inputs",
    "family_model",
    "perturb_",
    "tiny_family_config",
]


def _family(name: str) -> Family:
    try:
        return FAMILIES_MATRIX[name]
    except (KeyError, TypeError):
        best = difflib.get_close_matches(str(name), FAMILY_NAMES, n=3, cutoff=0.5)
        hint = f" Did you mean {' or '.join(map(repr, best))}?" if best else ""
        raise UnknownFamilyError(
            f"unknown model family {name!r}.{hint} Known: {', '.join(FAMILY_NAMES)}."
        ) from None


def tiny_family_config(name: str, **overrides: Any) -> PretrainedConfig:
    """The tiny HF config of family ``name`` with ``overrides`` applied.

    ``overrides`` use the family's own config names (``n_layer`` for GPT-2); an
    ``attn_implementation`` override replaces the family's attention implementation.
    Raises :class:`UnknownFamilyError` (a ``ValueError``) naming close matches.
    """
    # transformers is an optional dependency (the hf extra): imported only when building.
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    family = _family(name)
    # An override may use either spelling of an aliased key (GPT-2's ``hidden_size`` or
    # ``n_embd``): it replaces the table's value under the other spelling too.
    alias = dict(getattr(CONFIG_MAPPING[family.model_type], "attribute_map", {}))
    canonical = {alias.get(key, key) for key in overrides}
    values = {k: v for k, v in family.config.items() if alias.get(k, k) not in canonical}
    values = copy.deepcopy({**values, **overrides})  # configs mutate nested dicts in place
    # Per-layer patterns of the table follow a ``num_hidden_layers`` override (tiled).
    layers_key = alias.get("num_hidden_layers", "num_hidden_layers")
    layers = next((v for k, v in overrides.items() if alias.get(k, k) == layers_key), None)
    if isinstance(layers, int):
        for key in PER_LAYER_KEYS:
            pattern = values.get(key)
            if key not in overrides and isinstance(pattern, list) and pattern:
                values[key] = [pattern[i % len(pattern)] for i in range(layers)]
    attn = values.pop("attn_implementation", family.attn_implementation)
    values.setdefault("dtype", "float32")
    cfg = AutoConfig.for_model(family.model_type, **values)
    cfg._attn_implementation = attn
    return cfg


def build_family(
    name: str,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    perturb: float = 0.02,
    **overrides: Any,
) -> nn.Module:
    """The tiny causal LM of family ``name``, with seeded, non-trivial weights.

    The model is built by ``AutoModelForCausalLM.from_config`` after
    ``torch.manual_seed(seed)``, in fp32 on the CPU. Then every floating-point parameter
    gets ``perturb * randn`` added, drawn from a CPU ``torch.Generator`` seeded with
    ``seed``, so zero-initialised biases and ``1 + weight`` norm offsets are non-trivial
    too; buffers are left alone. Finally the parameters are cast to ``dtype`` and the model
    is moved to ``device``. Weights are thus drawn on the CPU whatever ``device`` is: the
    same arguments give bit-identical weights in any process and on any device (a CUDA
    rank and a CPU reference agree up to the cast).

    On ``device="meta"`` the model is built on the meta device (nothing is materialized)
    and the perturbation is skipped.
    """
    from transformers import AutoModelForCausalLM  # optional dependency (the hf extra)

    cfg = tiny_family_config(name, **overrides)
    device = torch.device(device)
    on_meta = device.type == "meta"
    torch.manual_seed(seed)
    with torch.device("meta" if on_meta else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg)
    if not on_meta and perturb:
        perturb_(model, seed=seed, scale=perturb)
    with torch.no_grad():
        if dtype != torch.float32:
            for param in model.parameters():
                if param.is_floating_point():
                    param.data = param.data.to(dtype)
            model.config.dtype = dtype
    if not on_meta and device.type != "cpu":
        model.to(device)
    return model


def perturb_(model: nn.Module, *, seed: int = 0, scale: float = 0.02) -> nn.Module:
    """Add ``scale * randn`` to every floating-point parameter in place; returns ``model``.

    The noise is drawn in fp32 from a CPU ``torch.Generator`` seeded with ``seed``, in
    parameter order, then cast to each parameter's dtype and device: the same model and
    arguments give bit-identical weights in any process. This is the perturbation
    :func:`build_family` applies (``perturb=scale``), so zero biases and unit norm weights
    make no comparison trivially equal. Buffers are left alone.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
                param.add_(noise.to(device=param.device, dtype=param.dtype), alpha=scale)
    return model


def family_model(name: str, **config: Any) -> nn.Module:
    """``build_family(name, seed=0)``: every weight shifted by seeded noise (no zero bias, no
    unit norm weight), without a padding id (as ``build_model``'s configs): the embedding
    then has no ``padding_idx`` row, whose gradient would be zero on both sides."""
    return build_family(name, seed=0, **{"pad_token_id": None, **config})


def family_batch(name: str, *, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    """Deterministic ``(batch, seq)`` input ids for family ``name``, in ``[3, vocab)``.

    Ids 0-2 are the pad/bos/eos tokens and are avoided.
    """
    vocab = _family(name).vocab_size
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(FIRST_ORDINARY_ID, vocab, (batch, seq), generator=gen)


def family_inputs(name: str, step: int) -> dict[str, torch.Tensor | bool]:
    """The keyword arguments of one training step of family ``name``: a batch factory.

    ``functools.partial(family_inputs, "llama")`` is what
    :func:`hp_core.testing.check_equivalence` takes as ``batch_factory`` (picklable).
    """
    ids = family_batch(name, seed=step)
    return {"input_ids": ids, "labels": ids, "use_cache": False}
