"""Dropout under tensor parallelism: replicated values stay identical across tp ranks, sharded
ones draw their own masks, and activation checkpointing replays the draws."""

from __future__ import annotations

import pytest

from hp_core.testing import get_world
from tests import dist_tasks_random as tasks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("mode", ["production", "validate"])
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_tp_replicated_values_are_bit_identical_with_dropout_on(sp, mode):
    for r in get_world(2).run(tasks.replicated_outputs_agree, sp, mode):
        # under SP only the embedding's output and the logits are whole on tp; without, every exit
        assert r["checked"] >= (2 if sp else 8) and r["differ"] == [] and r["logits_equal"], r


def test_without_the_streams_the_replicas_drift_apart():
    """Negative control: the same check fails when ranks draw from their own (differently seeded)
    streams."""
    for r in get_world(2).run(tasks.replicated_outputs_agree, False, "production", False):
        # (collective outputs are identical anyway: an all-reduce hides the drift in a wrong sum)
        assert "model.layers.0.input_layernorm" in r["differ"]


def test_draws_inside_a_sharded_region_differ_and_outside_agree():
    for r in get_world(2).run(tasks.sharded_draws_differ):
        assert r == {"inside_differ": True, "outside_equal": True, "user_stream_restored": True}


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_activation_checkpointing_replays_every_draw(mode):
    for r in get_world(2).run(tasks.checkpointing_replays_the_draws, mode):
        assert r["n"] > 0 and r["worst"] == 0.0, r
