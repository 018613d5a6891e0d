"""Inputs that the plan cannot take are refused on every rank with a clear error, never an abort.

Each bad call is followed by a good one on the same model: a refusal leaves nothing broken.
"""

from __future__ import annotations

import pytest

from hp_core.testing import get_world
from tests import dist_tasks_inputs as tasks

pytestmark = pytest.mark.distributed

CASES = {
    "odd_length": (
        "InputLayoutError",
        "model.layers.0 (input 'hidden_states'): it splits the sequence over tp=2 (sequence "
        "parallelism), but this batch has 15 positions",
        "Pad the sequence to a multiple of 2",
    ),
    "lengths_differ": (
        "InputMismatchError",
        "the ranks of one tp group were called with different inputs",
        "split data over the data-parallel axis only",
    ),
    "dtypes_differ": (
        "InputMismatchError",
        "the ranks of one tp group were called with different inputs",
        "int32",
    ),
    "values_differ": (
        "InputMismatchError",
        "the ranks of one tp group were called with different inputs",
        "DistributedSampler",
    ),
}


@pytest.mark.parametrize("mode", ["production", "validate"])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_inputs_are_refused_on_every_rank(case, mode):
    kind, first, fix = CASES[case]
    results = get_world(2).run(tasks.bad_inputs, case, mode)
    for r in results:
        assert r["type"] == kind, r
        assert (first in r["message"] and fix in r["message"]) or (
            case == "dtypes_differ" and first in r["message"]
        )
        assert r["then_ok"]
        # One guard all-reduce for the refused forward (it refused before the model's first
        # collective) and one for the good forward after it: the group stays in step.
        assert r["checks"] == 2, r["checks"]
    if case == "dtypes_differ":
        assert any("int32" in r["message"] for r in results)


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_generate_without_sequence_parallel_matches_one_device(mode):
    for r in get_world(2).run(tasks.generate, False, mode):
        assert r["type"] is None, r["message"]
        assert r["tokens"] == r["ref"] and r["loss_matches"]


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_generate_under_sequence_parallel_runs_its_decode_steps_whole(mode):
    """Prefill splits the sequence; each one-token decode step runs with the plan's
    whole-sequence variant (verified once, when first needed). Same tokens as one device."""
    for r in get_world(2).run(tasks.generate, True, mode):
        assert r["type"] is None, r["message"]
        assert r["tokens"] == r["ref"] and r["loss_matches"]
        assert r["whole_sequence_forwards"] >= 3  # the decode steps of 4 new tokens
        assert r["training_odd"] == "InputLayoutError"


def test_without_the_input_check_a_decode_step_under_sp_is_refused_with_the_fix():
    for r in get_world(2).run(tasks.generate, True, "production", False):
        assert r["type"] == "InputLayoutError"
        assert "1 positions along dim 1" in r["message"]
        assert (
            "generate() with a KV cache" in r["message"]
            and "sequence_parallel=False" in r["message"]
        )


def test_data_parallel_ranks_may_have_different_batches():
    assert all(r["matches"] for r in get_world(4).run(tasks.data_parallel_batches_may_differ))


def test_the_guard_can_be_turned_off():
    assert get_world(2).run(tasks.guard_off) == [{"guard": True}, {"guard": True}]
