"""Gathered tensors of re-arranged fused projections, back in the model's own order.

A tp rank of a fused projection (``qkv_proj``, ``gate_up_proj``, ``c_attn``) holds its
rows of every part, so the contiguous gather of ``gather_full_grads`` yields the parts
interleaved by rank. ``restore_fused`` puts such tensors back from the plan's own
declaration (each boundary's ``fused_layouts``: the part sizes along the fused dim), with
its own index arithmetic rather than hp's runtime, so a comparison against the
single-device model checks hp's re-arrangement instead of repeating it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["fused_parts", "restore_fused"]


def fused_parts(plan: object) -> dict[str, tuple[int, tuple[int, ...]]]:
    """``parameter FQN -> (fused dim, part sizes)`` of every re-arranged fused parameter."""
    out: dict[str, tuple[int, tuple[int, ...]]] = {}
    for fqn, spec in plan.items():  # type: ignore[attr-defined]
        for rel, data in spec._fused_layouts.items():
            if len(data["parts"]) > 1:
                out[f"{fqn}.{rel}" if fqn else rel] = (int(data["dim"]), tuple(data["parts"]))
    return out


def _unshuffle(t: torch.Tensor, dim: int, parts: tuple[int, ...], tp: int) -> torch.Tensor:
    # Gathered order: for each rank r, for each part p, part p's r-th chunk.
    chunks = list(t.split([p // tp for _ in range(tp) for p in parts], dim=dim))
    by_part = [[chunks[r * len(parts) + i] for r in range(tp)] for i in range(len(parts))]
    return torch.cat([torch.cat(c, dim=dim) for c in by_part], dim=dim)


def restore_fused(
    tensors: Mapping[str, torch.Tensor], plan: object, tp: int
) -> dict[str, torch.Tensor]:
    """``tensors`` (full, gathered by rank) with every re-arranged fused one in model order."""
    parts = fused_parts(plan)
    return {
        name: _unshuffle(t, *parts[name], tp) if name in parts and t is not None else t
        for name, t in tensors.items()
    }
