"""A row of the differential test matrix (:class:`Family`) and the shape every row shares.

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
    "BASE",
    "BOS_ID",
    "EOS_ID",
    "EXPERTS",
    "EXPERT_FFN",
    "FIRST_ORDINARY_ID",
    "PAD_ID",
    "PER_LAYER_KEYS",
    "TOKENS",
    "TOP_K",
    "WINDOW",
    "Family",
    "UnknownFamilyError",
    "hd",
    "llama_like",
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
    #: The dtype the differential matrix compares it in. float32 for all but a family whose
    #: float32 rounding alone exceeds the matrix's tolerance (its notes give the figures):
    #: there float64 tells a wrong result from rounding.
    compare_dtype: str = "float32"

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

TOKENS: dict[str, Any] = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}

#: Shape of a llama-like family (most of the table): the standard config names.
BASE: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    **TOKENS,
}

#: Config keys holding one entry per layer: tiled when ``num_hidden_layers`` is overridden.
PER_LAYER_KEYS = ("layer_types", "no_rope_layers")

#: The sliding window of the families that have one: shorter than the 16-token test batches
#: (:func:`~hp_core.testing.families.family_batch`), so a sliding layer's mask really drops
#: keys, and a plan that lost it would not match a single device.
WINDOW = 8

#: MoE shape: 4 experts, top-2, expert intermediate 32.
EXPERTS, TOP_K, EXPERT_FFN = 4, 2, 32


def llama_like(**extra: Any) -> dict[str, Any]:
    """The common tiny shape plus ``extra`` (the keyword spelling of llama-like configs)."""
    return {**BASE, "attention_dropout": 0.0, **extra}


def hd(**extra: Any) -> dict[str, Any]:
    """Llama-like with an explicit ``head_dim`` (families whose default is not hidden/heads)."""
    return llama_like(head_dim=16, **extra)
