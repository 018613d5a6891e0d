"""Injected compute and inner wrappers, applied for real under tp=2 and compared with one device."""

from __future__ import annotations

import pytest

from hp_core.testing import get_world
from tests import dist_tasks_inject as tasks

pytestmark = pytest.mark.distributed
TOL = 1e-5


@pytest.mark.parametrize("mode", ["production", "validate"])
@pytest.mark.parametrize(
    "case",
    [
        "local_compute_by_name",
        "local_compute_dispatching",
        "self_wrapper",
        "self_wrapper_local",
        "in_place_wrapper",
        "child_wrapper",
    ],
)
def test_injection_matches_single_device(case, mode):
    for r in get_world(2).run(tasks.injected, case, mode):
        assert "error" not in r, r
        assert r["loss"] < TOL and r["logits"] < TOL and r["grad"] < TOL and r["n_grads"] > 0, r
        if "wrapper" in case:
            target = "model.layers.0.self_attn" + (".o_proj" if case == "child_wrapper" else "")
            assert r["resolved"]["model.layers.0.self_attn"][1] == target


def test_child_output_checked_against_inner_out_src_in_validate():
    for r in get_world(2).run(tasks.injected, "child_wrapper_wrong_layout", "validate"):
        assert r["error"] == "PlacementMismatchError" and r["stage"] == "inner_out_src"
        assert "model.layers.0.self_attn.o_proj: inner_out_src placement mismatch" in r["message"]
        assert (
            "expected (plan): {tp: shard(2)}" in r["message"]
            and "actual (DTensor propagation): {tp: partial}" in r["message"]
        )


def test_wrong_out_src_caught_in_validate():
    for r in get_world(2).run(tasks.injected, "wrong_out_src", "validate"):
        assert r["error"] == "PlacementMismatchError" and r["stage"] == "out_src[attn_output]"
        assert (
            "expected (plan): {tp: replicate}" in r["message"]
            and "actual (DTensor propagation): {tp: partial}" in r["message"]
        )


def test_wrapper_that_neither_returns_nor_installs():
    for r in get_world(2).run(tasks.injected, "forgets_to_install", "production"):
        assert r["error"] == "InjectionBindingError"
        assert "returned None but did not replace LlamaAttention.forward" in r["message"]


def test_target_config_typo_names_the_closest_key():
    for r in get_world(2).run(tasks.injected, "target_config_typo", "production"):
        assert r["error"] == "InjectionBindingError"
        assert (
            "unknown config key 'scael'" in r["message"] and "Did you mean 'scale'?" in r["message"]
        )
