"""Multi-head latent attention (DeepSeek-V2/V3): which projections are latent, which per head.

MLA compresses the hidden state into small latents shared by every head and expands
them per head::

    hidden ─ q_a (down) ─ norm ─ q_b (up, per head) ─┐          (or one q projection)
    hidden ─ kv_a (down) ─┬─ norm ─ kv_b (up, per head) ─ attention ─ o (rowwise)
                          └─ k_pe: one rope key, broadcast to every head

Under tensor parallelism the latents stay whole (the down projections and their norms
are replicated), the up projections are column-parallel by heads, the output projection
rowwise. Each rank's gradient of a latent is its heads' share: partial over tp. That is
not declared here: the region dispatches through DTensor, whose propagation finds it
(``hp_core.runtime.broadcast`` lets it see the shared rope key as the broadcast it is).

Recognised from the ``nn.Linear`` children's shapes against the hidden size:

* an *up* projection reads a latent (``in_features != hidden``) and writes heads
  (``out_features != hidden``, a multiple of the head count);
* a *down* projection reads the hidden state and writes a latent an up projection reads
  (its width, or that width plus the rope key's ``qk_rope_head_dim`` from the config);
* an *output* projection writes the hidden state from heads;
* a projection from the hidden state to heads that is no down projection (the plain
  query projection of the no-q-LoRA variant) is column-parallel like an up projection.

A block without both a down and an up projection is no MLA block.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from hp_core.planner.templates.per_head import head_counts

__all__ = ["LatentProjections", "latent_projections"]


@dataclasses.dataclass(frozen=True)
class LatentProjections:
    """Child module names of an MLA block, by what they do."""

    down: tuple[str, ...]
    up: tuple[str, ...]
    out: tuple[str, ...]


def _hidden(module: nn.Module) -> int | None:
    cfg = getattr(module, "config", None)
    for src in (module, cfg):
        value = getattr(src, "hidden_size", None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def latent_projections(module: nn.Module) -> LatentProjections | None:
    """The down/up/output projections of an MLA block, or None when ``module`` is not one."""
    hidden = _hidden(module)
    counts = head_counts(module)
    if hidden is None or counts is None:
        return None
    heads = counts[0]
    linears = {n: m for n, m in module.named_children() if isinstance(m, nn.Linear)}
    up = {
        n: m
        for n, m in linears.items()
        if m.in_features != hidden and m.out_features != hidden and m.out_features % heads == 0
    }
    widths = {m.in_features for m in up.values()}
    rope = getattr(getattr(module, "config", None), "qk_rope_head_dim", 0)
    rope = rope if isinstance(rope, int) and not isinstance(rope, bool) else 0
    down = [
        n
        for n, m in linears.items()
        if m.in_features == hidden and (m.out_features in widths or m.out_features - rope in widths)
    ]
    if not up or not down:
        return None
    out = [
        n
        for n, m in linears.items()
        if m.out_features == hidden and m.in_features % heads == 0 and n not in down
    ]
    plain_q = [
        n
        for n, m in linears.items()
        if n not in down
        and n not in out
        and m.in_features == hidden
        and m.out_features % heads == 0
    ]
    return LatentProjections(tuple(down), (*up, *plain_q), tuple(out))
