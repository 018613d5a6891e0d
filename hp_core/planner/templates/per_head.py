"""Per-head parameters: weights with one row (or one value) per attention head.

Cohere's q/k LayerNorm weights are ``[heads, head_dim]``, gpt-oss's attention sinks one
scalar per head. When an attention block splits its heads over tp, each rank must hold
the rows of its own heads: ``Shard(0)``, like the projections that make those heads.

Recognised from shapes against the head counts of the module (or its config); names
play no part:

* a 2-D parameter of shape ``(heads, head_dim)`` or ``(kv_heads, head_dim)``;
* a 1-D parameter of ``heads`` (or ``kv_heads``) values held directly by the attention
  module (a norm submodule's 1-D weight is per channel of ``head_dim``, not per head).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:  # structure imports the MLA detection, which uses head_counts
    from hp_core.planner.structure import Block

__all__ = ["head_counts", "per_head_params"]


def head_counts(module: nn.Module) -> tuple[int, int, int] | None:
    """``(heads, kv_heads, head_dim)`` of an attention module, from its attributes or config."""
    cfg = getattr(module, "config", None)

    def first(*names: str) -> int | None:
        for src in (module, cfg):
            for name in names:
                value = getattr(src, name, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
        return None

    heads = first("num_heads", "num_attention_heads", "n_heads", "n_head")
    if heads is None:
        return None
    kv = first("num_key_value_heads", "num_kv_heads", "n_kv_heads") or heads
    hidden = first("hidden_size")
    head_dim = first("head_dim") or (hidden // heads if hidden else None)
    if head_dim is None:
        return None
    return heads, kv, head_dim


def per_head_params(block: Block) -> list[str]:
    """The parameters of ``block`` (relative names) that hold one row or value per head."""
    counts = head_counts(block.module)
    if counts is None:
        return []
    heads, kv, head_dim = counts
    out = []
    for rel, shape in block.shapes.items():
        if len(shape) == 2 and shape[0] in (heads, kv) and shape[1] == head_dim:
            out.append(rel)
        elif len(shape) == 1 and "." not in rel and shape[0] in (heads, kv):
            out.append(rel)
    return out
