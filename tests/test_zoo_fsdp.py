"""Two zoo models (tests/zoo) with hp on tp inside and FSDP2 on dp outside: one device's.

World 4 (dp=2 x tp=2), nanoGPT and the torchtitan-style Llama, both modes, sequence
parallel on and off, 3 AdamW steps (lr 1e-3). Each dp replica trains on its own batch; the
single-device reference trains on both (the mean of their losses), so FSDP2's averaging is
part of what is checked. Per step: the loss (dp-averaged), this replica's logits, every
gradient gathered whole, the clipped total norm (the recipe clips, hp's clip against torch's
on one device); after the steps, every parameter gathered whole. FSDP2 wraps every
repeated block the model has (``transformer.h.*``, ``layers.*``), found from its structure.

One world run per entry covers its four combinations and two negative controls (hp's derived
reductions dropped; FSDP2 summing over dp instead of averaging): the runs are cached and
each combination is asserted on its own.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from hp_core.testing import get_world
from tests import dist_tasks_zoo_fsdp as tasks

pytestmark = pytest.mark.distributed
TOL = 1e-5
ENTRIES = ["nanogpt", "torchtitan_llama"]
BLOCKS = {
    "nanogpt": ["transformer.h.0", "transformer.h.1"],
    "torchtitan_llama": ["layers.0", "layers.1"],
}


@functools.cache
def _results(name: str) -> tuple[dict[str, Any], ...]:
    return tuple(get_world(4).run(tasks.train, name, timeout=600))


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
@pytest.mark.parametrize("mode", ["production", "validate"])
@pytest.mark.parametrize("name", ENTRIES)
def test_zoo_model_under_fsdp2_over_tp_matches_one_device(name: str, mode: str, sp: bool) -> None:
    for rank_results in _results(name):
        r = rank_results[f"{mode}:{'sp' if sp else 'no-sp'}"]
        assert r["blocks"] == BLOCKS[name], r["blocks"]
        assert "problems" not in r, r["problems"]
        for what in ("loss", "logits", "grad", "norm", "param"):
            assert r[what] <= TOL, (what, r["off"])
        assert r["logits_compared"], r
        assert max(r["norms"]) > tasks.MAX_NORM, r["norms"]  # the clip really scaled a step
        # every parameter has a gradient, is compared, and moved on every step
        assert r["n_grads"] == r["n_params"] == r["n_ref_params"] > 0, r
        assert r["unmoved"] == [] and r["min_checked"] > 0, r
        if sp:  # the norms' partial gradients are summed once per step, after FSDP2's
            per_step = r["reductions"][0]
            assert per_step > 0 and r["reductions"] == [per_step * k for k in (1, 2, 3)], r


NORMS = {"nanogpt": "transformer.h.0.ln_1.weight", "torchtitan_llama": "norm.weight"}


@pytest.mark.parametrize("name", ENTRIES)
def test_without_hps_reductions_the_comparison_fails(name: str) -> None:
    """Negative control: hp's derived sums dropped, the sequence-parallel norms' gradients
    stay partial (they differ across tp ranks) and the gradient check refuses them."""
    for rank_results in _results(name):
        r = rank_results["no-hp-reductions"]
        assert r["grad"] > 1e-3, r
        assert f"{NORMS[name]}: replicas differ across mesh axis 'tp'" in r["problems"], r


@pytest.mark.parametrize("name", ENTRIES)
def test_without_the_dp_average_the_comparison_fails(name: str) -> None:
    """Negative control: FSDP2 summing the replicas' gradients instead of averaging them
    leaves the loss right and every gradient doubled: the comparison catches it."""
    for rank_results in _results(name):
        r = rank_results["no-dp-average"]
        assert r["loss"] <= TOL and "problems" not in r, r
        assert r["grad"] > 1e-3, r
