"""Checks of the CP attention and loss helpers that fire before any communication (in-process)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from hp_plugin_cp.attention import _block_mask, _global_score_mod
from torch import nn

from hp_core.context import ParallelContext
from hp_plugin_cp import (
    CPBatchError,
    CPConfigError,
    CPLayout,
    CPUnsupportedError,
    cp_global_loss,
    cp_sdpa,
    enable_cp_loss,
    flex_hf,
    reduce_cp_gradients,
)


def _cp_rank() -> SimpleNamespace:
    """All these checks fire before a mesh is used for anything but its axis name."""
    return SimpleNamespace(mesh_dim_names=("cp",))


def _qkv(q_len: int = 4, k_len: int = 4, dims: int = 4) -> tuple[torch.Tensor, ...]:
    shape = (1, 2, q_len, 8)[4 - dims :]
    return (
        torch.zeros(shape),
        torch.zeros((1, 2, k_len, 8)[4 - dims :]),
        torch.zeros((1, 2, k_len, 8)[4 - dims :]),
    )


@pytest.mark.parametrize(
    ("qkv", "layout", "error", "words"),
    [
        (_qkv(dims=3), CPLayout(2, 0, 8), CPBatchError, "SDPA layout"),
        (_qkv(4, 6), CPLayout(2, 0, 8), CPUnsupportedError, "use_cache=False"),
        (_qkv(), CPLayout(2, 0, 16), CPBatchError, "sees 4 local positions"),
    ],
    ids=["not-4d", "kv-longer", "wrong-layout"],
)
def test_cp_sdpa_checks_before_gathering(qkv, layout, error, words):
    with pytest.raises(error, match=words):
        cp_sdpa(*qkv, group=None, layout=layout, causal=True, where="t")


def test_score_mod_sees_global_positions():
    seen = []
    mod = _global_score_mod(
        lambda s, b, h, q, k: seen.append((int(q), int(k))) or s,
        torch.tensor([6, 7]),
        torch.tensor([0, 1, 6, 7]),
    )
    assert mod(1.0, 0, 0, torch.tensor(1), torch.tensor(2)) == 1.0
    assert seen == [(7, 6)]


def test_flex_block_mask_cases():
    q = torch.zeros(1, 2, 4, 8)
    assert _block_mask(CPLayout(2, 0, 8), False, q, 8, "t") is None  # nothing to hide
    four_d = CPLayout(2, 0, 8, attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))
    with pytest.raises(CPUnsupportedError, match="2-D padding mask"):
        _block_mask(four_d, True, q, 8, "t")


def test_enable_cp_loss_needs_an_hf_style_loss():
    with pytest.raises(CPBatchError, match="reduce_loss_over_cp"):
        enable_cp_loss(nn.Linear(2, 2), _cp_rank())


def test_the_equivalence_loss_hook_needs_an_applied_model():
    with pytest.raises(CPConfigError, match=r"has not been applied by hp.*after_apply"):
        cp_global_loss(nn.Linear(2, 2), "production")


def test_reduce_cp_gradients_without_gradients_is_a_no_op():
    assert reduce_cp_gradients(nn.Linear(2, 2), _cp_rank()) == 0


def test_flex_hf_without_transformers_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers.integrations.flex_attention", None)
    with pytest.raises(CPConfigError, match="Fix: install transformers, or use flex_qkv"):
        flex_hf(
            target_module=nn.Linear(2, 2), ctx=ParallelContext(("cp",), (2,), cp_mesh=_cp_rank())
        )
