"""Attention blocks for the local-program gate's tests (importable by the spawned ranks).

Each is placed in ``tests.forward_examples.Net``; the projections have names hp has no
rule for (``wq``/``wk``/``wv``/``wo``), so the structure (the meta trace) finds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import hp_core.planner.plan as planner
from hp_core.testing import equivalence_on_rank
from tests import forward_examples as fe
from tests.forward_examples import DIM, HEADS, Net


class _Renamed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM)

    def heads(self) -> int:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            w(x).view(b, t, self.heads(), -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class KnownCount(_Renamed):
    """The head count under a name hp knows (``n_head``): made local by the structure."""

    def __init__(self) -> None:
        super().__init__()
        self.n_head = HEADS

    def heads(self) -> int:
        return self.n_head


class OwnCount(_Renamed):
    """The head count under a name of its own (``width_groups``): found by the search."""

    def __init__(self) -> None:
        super().__init__()
        self.width_groups = HEADS

    def heads(self) -> int:
        return self.width_groups


class ConstantCount(_Renamed):
    """The head count a module constant (``n_head`` is there, unused): no attribute fixes
    the local program, so the search finds nothing and the block is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.n_head = HEADS

    def heads(self) -> int:
        return HEADS


class NotOnMeta(nn.Module):
    """Projections named as hp knows them (no trace needed to plan) in a forward that cannot
    run on the meta device: nothing to trace, so the verifier is the check, as before."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = HEADS
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(DIM, DIM) for _ in range(3))
        self.o_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:
            raise RuntimeError("this forward needs real data")
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.num_heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def known_count() -> Net:
    return fe.seeded_net(KnownCount)


def own_count() -> Net:
    return fe.seeded_net(OwnCount)


def constant_count() -> Net:
    return fe.seeded_net(ConstantCount)


def not_on_meta() -> Net:
    return fe.seeded_net(NotOnMeta)


def ungated_equivalence() -> dict[str, float]:
    """Rank task: the equivalence check of ``own_count`` planned with the gate switched off."""
    gate = planner.prove_local_programs
    planner.prove_local_programs = lambda *args, **kwargs: None
    try:
        report = equivalence_on_rank(
            own_count, fe.batch, "tp=2", loss_fn=fe.loss, raise_on_failure=False
        )
    finally:
        planner.prove_local_programs = gate
    return dict(report.worst)
