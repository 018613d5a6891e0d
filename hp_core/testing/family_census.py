"""A census of every causal-LM family of the installed ``transformers``: what the matrix covers.

:func:`census` classifies every key of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` into one
:data:`KINDS` entry, with a one-line reason read off the code where the code tells:

* ``matrix`` — a :data:`~hp_core.testing.family_matrix.FAMILIES_MATRIX` row builds it;
* ``same-class`` — it maps to the same model class as another key that is covered (a matrix
  row, or a ``decoder-only`` key), e.g. ``exaone -> LlamaForCausalLM``;
* ``encoder`` — a bidirectional encoder with a causal head (it has a masked-LM model);
* ``encoder-decoder`` — the decoder half of a seq2seq model (its config defaults to
  ``is_encoder_decoder``, or it has a seq2seq model);
* ``multimodal`` — a vision/audio model (a ``ForConditionalGeneration`` class, a vision or
  audio sub-config, or an image-text-to-text model);
* ``decoder-only`` — everything else, with a sub-kind read off its config's fields: ``dense``,
  ``moe``, ``mla`` or ``recurrent/hybrid`` (state-space, linear-attention, recurrent layers).

Data and logic only: this module imports no ``transformers``. The caller reads the installed
library and passes what it read (:class:`Sources`): the causal-LM mapping, the config class
of each key, and the keys of the masked-LM, seq2seq and multimodal mappings. A key the
census cannot place (no config class) is ``unclassified``.

Every ``decoder-only`` key must be a matrix row or be listed in :data:`NOT_YET` with the
reason; that table shrinks as rows are added.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from hp_core.testing.family_matrix import FAMILIES_MATRIX, Family

__all__ = [
    "BY_HAND",
    "KINDS",
    "NOT_YET",
    "Entry",
    "Sources",
    "census",
    "config_fields",
    "decoder_only_subkind",
]

KINDS = (
    "matrix",
    "same-class",
    "encoder",
    "encoder-decoder",
    "multimodal",
    "decoder-only",
    "unclassified",
)


@dataclass(frozen=True)
class Entry:
    """The census of one key: its kind, a sub-kind (decoder-only families), and why."""

    kind: str
    reason: str
    subkind: str = ""
    model_class: str = ""


@dataclass(frozen=True)
class Sources:
    """What the census reads from the installed library (passed in: no import here).

    ``causal_lm`` is ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (key -> model class name);
    ``config_classes`` maps a key to its config class (``CONFIG_MAPPING``); ``masked_lm``,
    ``seq2seq`` and ``multimodal`` are the keys of those auto mappings.
    """

    causal_lm: Mapping[str, str]
    config_classes: Mapping[str, type]
    masked_lm: Collection[str] = ()
    seq2seq: Collection[str] = ()
    multimodal: Collection[str] = ()
    families: Mapping[str, Family] = field(default_factory=lambda: FAMILIES_MATRIX)


#: What the code cannot tell: key -> (kind, reason).
BY_HAND: dict[str, tuple[str, str]] = {
    "trocr": (
        "encoder-decoder",
        "the text decoder of TrOCR, run under VisionEncoderDecoderModel after an image encoder",
    ),
    "bert-generation": (
        "encoder",
        "a BERT encoder stack used as the decoder of an EncoderDecoderModel (is_decoder flag)",
    ),
    "xlnet": ("encoder", "permutation LM over bidirectional context (two-stream attention)"),
}

#: Sub-kinds read off a config's field names (first match wins, in this order).
_RECURRENT = re.compile(
    r"mamba|ssm|state_size|conv_kernel|conv_l_cache|conv1d|^lru_|^linear_(conv|num|key|value|head)"
    r"|block_type|chunkwise_kernel|rescale_every|^attention_hidden_size$"
)
_MLA = re.compile(r"^(kv|q)_lora_rank$")
_MOE = re.compile(r"expert|moe")
#: A boolean field that switches MoE on (its default decides).
_MOE_SWITCH = re.compile(r"^(is|enable|use)_moe(_block)?$")
_MODALITY = re.compile(r"vision|audio|image|speech|^vq_")


def config_fields(config_class: type) -> dict[str, Any]:
    """The declared fields of a config class and their defaults (dataclass or ``__init__``)."""
    if dataclasses.is_dataclass(config_class):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(config_class):
            out[f.name] = f.default if f.default is not dataclasses.MISSING else None
        return out
    params = inspect.signature(config_class).parameters
    return {
        n: (p.default if p.default is not inspect.Parameter.empty else None)
        for n, p in params.items()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }


def decoder_only_subkind(config_class: type) -> tuple[str, str]:
    """``(sub-kind, why)`` of a decoder-only family from its config's field names."""
    fields = config_fields(config_class)
    name = config_class.__name__
    hits = sorted(f for f in fields if _RECURRENT.search(f.lower()))
    if hits:
        return "recurrent/hybrid", f"{name} has {', '.join(hits[:3])}"
    hits = sorted(f for f in fields if _MLA.search(f))
    if hits:
        return "mla", f"{name} has {', '.join(hits)}"
    switches = [f for f in fields if _MOE_SWITCH.search(f)]
    hits = sorted(f for f in fields if _MOE.search(f.lower()) and f not in switches)
    if hits and not (switches and not any(fields[s] for s in switches)):
        return "moe", f"{name} has {', '.join(hits[:3])}"
    off = f" ({switches[0]}=False by default)" if hits else ""
    return "dense", f"attention + MLP: {name} has no expert, latent or state-space field{off}"


def _stem(name: str) -> str:
    """``Glm4MoeForCausalLM`` -> ``glm4moe``; ``glm4_moe`` -> ``glm4moe``."""
    name = re.sub(r"(ForCausalLM|LMHeadModel|WithLMHead|ForConditionalGeneration)$", "", name)
    return re.sub(r"[^0-9a-z]", "", name.lower())


def _multimodal_reason(key: str, cls_name: str, cfg: type, src: Sources) -> str | None:
    if cls_name.endswith("ForConditionalGeneration"):
        return f"{cls_name} is a ForConditionalGeneration model"
    subs = sorted(getattr(cfg, "sub_configs", None) or {})
    modal = [s for s in subs if _MODALITY.search(s)]
    if modal:
        return f"{cfg.__name__} has {', '.join(modal)}"
    if key in src.multimodal:
        return "it has an image-text-to-text / multimodal-LM model"
    return None


def _classify(key: str, src: Sources, by_class: Mapping[str, str]) -> Entry:
    cls_name = src.causal_lm[key]
    rows = [f for f in src.families.values() if f.model_type == key]
    cfg = src.config_classes.get(key)
    if rows:
        sub = decoder_only_subkind(cfg)[0] if cfg is not None else ""
        return Entry("matrix", f"matrix row {rows[0].name!r}", subkind=sub, model_class=cls_name)
    if cls_name in by_class:
        return Entry(
            "same-class",
            f"maps to {cls_name}, as matrix row {by_class[cls_name]!r} does",
            model_class=cls_name,
        )
    if key in BY_HAND:
        kind, why = BY_HAND[key]
        return Entry(kind, f"by hand: {why}", model_class=cls_name)
    if cfg is None:
        return Entry("unclassified", "no config class for this key", model_class=cls_name)
    if getattr(cfg, "is_encoder_decoder", False) is True:
        why = f"{cfg.__name__} defaults to is_encoder_decoder=True"
        return Entry("encoder-decoder", why, model_class=cls_name)
    modal = _multimodal_reason(key, cls_name, cfg, src)
    if modal:
        return Entry("multimodal", modal, model_class=cls_name)
    if key in src.seq2seq:
        return Entry("encoder-decoder", "it has a seq2seq model", model_class=cls_name)
    if key in src.masked_lm:
        why = "it has a masked-LM model: a bidirectional encoder whose causal head sets is_decoder"
        return Entry("encoder", why, model_class=cls_name)
    sub, why = decoder_only_subkind(cfg)
    return Entry("decoder-only", why, subkind=sub, model_class=cls_name)


def census(src: Sources) -> dict[str, Entry]:
    """Every key of ``src.causal_lm`` -> its :class:`Entry`, in the mapping's order."""
    by_class: dict[str, str] = {}
    for row in src.families.values():
        cls_name = src.causal_lm.get(row.model_type)
        if cls_name is not None:
            by_class.setdefault(cls_name, row.name)
    out = {key: _classify(key, src, by_class) for key in src.causal_lm}
    # Decoder-only keys sharing a class with another: the one whose name is the class's
    # stays, the others are the same class (``param2moe`` and ``sarvam_moe`` -> glm4_moe).
    groups: dict[str, list[str]] = {}
    for key, e in out.items():
        if e.kind == "decoder-only":
            groups.setdefault(e.model_class, []).append(key)
    for cls_name, keys in groups.items():
        if len(keys) < 2:
            continue
        named = [k for k in keys if _stem(k) == _stem(cls_name)]
        keep = named[0] if named else keys[0]
        for key in keys:
            if key != keep:
                why = f"maps to {cls_name}, as decoder-only key {keep!r} does"
                out[key] = Entry("same-class", why, model_class=cls_name)
    return out


#: Decoder-only keys with no matrix row yet, and why. Shrinks to empty as rows are added.
NOT_YET: dict[str, str] = {
    "blt": (
        "byte latent transformer (local encoder, global transformer, local decoder with cross- "
        "attention and a patcher): no tiny row attempted yet"
    ),
    "gemma4_assistant": (
        "a speculative-decoding draft head: its forward needs the target model's inputs_embeds and "
        "shared_kv_states (no input_ids/labels training step)"
    ),
    "gemma4_unified_assistant": (
        "a speculative-decoding draft head: its forward needs the target model's inputs_embeds and "
        "shared_kv_states (no input_ids/labels training step)"
    ),
}
