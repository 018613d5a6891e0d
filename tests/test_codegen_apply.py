"""A plan rebuilt from an artifact, applied on real gloo ranks, behaves exactly like the live
plan."""

from __future__ import annotations

import pytest

from hp_core.testing import get_world
from tests import dist_tasks_codegen as tasks

pytestmark = pytest.mark.distributed


def test_rebuilt_plan_matches_live_plan_tp2_llama():
    results = get_world(2).run(tasks.rebuilt_vs_live, "llama")
    assert results[0]["signature"] == results[1]["signature"]  # both ranks froze identical bytes
    for r in results:
        assert r["differences"] == []
        assert r["n_grads"] == r["n_params"] > 0
        for mode in ("production", "validate"):
            # The same plan runs the same ops: identical outputs and gradients.
            assert r[f"{mode}:rebuilt-live"] == {"loss": 0.0, "grads": 0.0}, r
            assert (
                r[f"{mode}:rebuilt-ref"]["loss"] < 1e-5 and r[f"{mode}:rebuilt-ref"]["grads"] < 1e-5
            ), r
