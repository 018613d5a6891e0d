"""Rank-side hooks and tasks of the equivalence-check tests (importable by the spawned ranks).

The hooks are negative controls: each breaks one thing the check must catch, in a way the
other mode (or the plan verifier) does not see.
"""

from __future__ import annotations

import torch
from torch import nn

from hp_core import ShardingPlan
from hp_core.testing import EquivalenceError, equivalence_on_rank


def fused_as_plain_rows(p: ShardingPlan) -> ShardingPlan:
    """Forget every fused q/k/v layout: ``c_attn`` is then split as plain column-parallel.

    Production shards it in contiguous rows (rank 0 gets q and half of k); validate runs the
    model's own forward on DTensors, whose split of the whole ``c_attn`` output is correct.
    """
    for _fqn, spec in p.items():
        spec._fused_layouts = {}
    return p


def perturb_production_attention(model: nn.Module, mode: str) -> None:
    """Production's first attention computes another function: its q/k/v weights move."""
    if mode == "production":
        with torch.no_grad():
            model.get_submodule("transformer.h.0.attn.c_attn").weight.add_(0.05)


def drop_reductions(model: nn.Module, mode: str) -> None:
    """The runtime forgets the gradient sums the plan derived (gradients stay partial)."""
    reducer = model._hp_applied.grad_reducer  # type: ignore[union-attr]
    if reducer is not None:
        reducer.buckets = []


def raises_on_rank(model_factory: str, batch_factory: str) -> dict[str, object]:
    """equivalence_on_rank with a dropped reduction: what every rank's error says."""
    try:
        equivalence_on_rank(
            model_factory,
            batch_factory,
            "tp=2",
            modes=("production",),
            steps=1,
            after_apply=drop_reductions,
        )
    except EquivalenceError as e:
        return {"type": type(e).__name__, "message": str(e), "worst": e.report.worst}
    return {"type": None}
