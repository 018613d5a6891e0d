"""``hp_core.clip_grad_norm_`` equals torch's clip on the unsharded single-device model.

Each distributed case runs one forward/backward per norm type on a seeded tiny model and
on a parallel copy (real gloo ranks, one shared world per size), clips the reference
with ``torch.nn.utils.clip_grad_norm_`` and the copy with ``hp_core.clip_grad_norm_``
(``max_norm`` a quarter of the norm, so both clip), and checks: the two norms agree to
1e-6 relative on every rank, and the gathered full gradients of the copy equal the
reference's clipped ones. The gradients are also compared before clipping, so that a
wrong composition (DDP, FSDP2) is told apart from a wrong clip. The negative control
(local norms summed over the group) shows the norm check can fail.
"""

from __future__ import annotations

import math

import pytest
from torch import nn

import hp_core
from hp_core.runtime.clip import GradNormTypeError, NotAppliedError
from hp_core.testing import get_world
from tests import dist_tasks_clip as tasks

pytestmark = pytest.mark.distributed

NORM_TOL = 1e-6  # relative, on the returned norm
GRAD_TOL = 1e-5  # allclose excess (rtol 1e-5), on every gradient


def _check(result: dict, norm_types: tuple[str, ...], *, naive: bool = True) -> None:
    assert result["n_grads"] > 0
    for p in norm_types:
        r = result[p]
        assert r["zero_dim"] and r["same_on_ranks"], (p, r)
        assert r["pre"] <= GRAD_TOL, f"{p}: gradients differ before clipping: {r}"
        assert r["rel"] <= NORM_TOL, f"{p}: norm {r['par']} vs torch's {r['ref']}: {r}"
        assert r["post"] <= GRAD_TOL, f"{p}: clipped gradients differ: {r}"
    if naive:  # the negative control: the usual mistake is caught by the norm check
        assert result["2.0"]["naive_rel"] > 10 * NORM_TOL, result["2.0"]


@pytest.mark.parametrize("mode", ["production", "validate"])
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_tp2(mode, sp):
    """Sharded and replicated weights on tp=2; norm types 2, 1 and inf."""
    for r in get_world(2).run(tasks.tp, mode, sp):
        _check(r, ("2.0", "1.0", "inf"))


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_tp2_tied(mode):
    """A vocab-parallel embedding tied to the lm head counts once."""
    for r in get_world(2).run(tasks.tp, mode, True, tie_word_embeddings=True):
        _check(r, ("2.0", "1.0", "inf"))


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_dp2_tp2(wrap):
    """dp=2 x tp=2 (production): DDP over mesh["dp"], or FSDP2 fully_shard per layer + root."""
    results = get_world(4).run(tasks.dp_tp, "ddp" if wrap == "ddp" else "fsdp")
    for r in results:
        _check(r, ("2.0", "1.0", "inf"), naive=wrap == "ddp")
        if wrap == "fsdp2":  # FSDP2 really holds the gradients: DTensors sharded over dp
            assert r["n_dtensor_grads"] == r["n_grads"]
            assert r["replicas"] == [1, 2]  # dp x tp shards; dp shards copied over tp
        else:
            assert r["replicas"] == [2, 4]  # tp shards copied over dp; copies everywhere


def test_dp2_tp2_fsdp2_validate():
    """Validate mode under FSDP2: hp's tp DTensors become (dp, tp) DTensors whose dp split of
    a tp-sharded dim is a ``_StridedShard`` (not a ``Shard`` subclass): still one chunk."""
    for r in get_world(4).run(tasks.dp_tp, "fsdp", "validate"):
        _check(r, ("2.0", "1.0", "inf"), naive=False)
        assert r["n_dtensor_grads"] == r["n_grads"]
        assert r["replicas"] == [1, 2]  # dp x tp shards; dp shards copied over tp


def test_ep2_tp2():
    """Qwen2-MoE, tp=2 with sequence parallelism, experts sharded over ep=2, both modes."""
    for r in get_world(2).run(tasks.ep):
        for mode in ("production", "validate"):
            _check(r[mode], ("2.0", "inf"))


def test_cp2():
    """cp=2 (hp-plugin-cp): every gradient summed over cp, so each is a copy on both ranks."""
    for r in get_world(2).run(tasks.cp):
        _check(r, ("2.0", "1.0"))
        assert r["replicas"] == [2]
        assert r["2.0"]["naive_rel"] == pytest.approx(math.sqrt(2) - 1, rel=1e-4)


def test_error_if_nonfinite():
    for r in get_world(2).run(tasks.nonfinite):
        assert r["raised"] == "NonFiniteGradNormError" and r["is_hp_error"], r
        assert "non-finite" in r["message"] and "error_if_nonfinite=False" in r["message"]
        assert r["untouched"]  # raised before scaling anything
        assert r["total"] == math.inf  # without the flag: the norm, on every rank


def test_plain_model_is_refused():
    model = nn.Linear(4, 4)
    model(model.weight).sum().backward()
    with pytest.raises(NotAppliedError) as info:
        hp_core.clip_grad_norm_(model, 1.0)
    assert isinstance(info.value, hp_core.HpError) and isinstance(info.value, TypeError)
    message = str(info.value)
    assert message.startswith("hp_core.clip_grad_norm_: Linear was not parallelized by hp")
    assert "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)" in message
    assert "hp_core.apply" in message


@pytest.mark.parametrize("norm_type", [0, -2.0, math.nan, "two"])
def test_bad_norm_type(norm_type):
    with pytest.raises(GradNormTypeError, match=r"norm_type=.*positive number or inf"):
        hp_core.clip_grad_norm_(nn.Linear(2, 2), 1.0, norm_type)
