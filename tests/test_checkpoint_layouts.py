"""A production model's state dict carries its layouts, so DCP saves and restores it.

Before this, production parameters were plain local shards: ``dcp.save`` wrote every
rank's shard under one key as if replicated and ``dcp.load`` restored wrong values. Each
case runs on a real gloo world (tp=2) against the seeded single-device weights.
"""

from __future__ import annotations

import pytest

from hp_core.testing import get_world
from tests import dist_tasks_checkpoint as tasks

pytestmark = pytest.mark.distributed

TOL = 1e-6


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_dcp_save_scramble_load_and_reshard_to_one_process(tmp_path, mode):
    results = get_world(2).run(tasks.dcp_round_trip, str(tmp_path / mode), mode)
    for r in results:
        # tp-sharded projections and the vocab-parallel embedding/head are DTensors;
        # replicated norms stay plain tensors (identical on every rank).
        assert "model.layers.0.self_attn.q_proj.weight" in r["sharded_keys"]
        assert "model.embed_tokens.weight" in r["sharded_keys"]
        if mode == "production":
            assert "model.norm.weight" in r["plain_keys"]
        assert r["saved_excess"] <= TOL  # the saved views are the model's own values
        assert r["scrambled"] > 0.5  # the negative control: the scramble really changed them
        assert r["restored"] <= TOL, r
        assert r["logits"] <= TOL, r
    # Rank 0 loaded the tp=2 checkpoint into one whole model in a single process.
    assert results[0]["single"] is not None and results[0]["single"] <= TOL, results[0]


def test_full_tensors_load_into_shards_and_a_local_shard_is_refused():
    for r in get_world(2).run(tasks.load_full_and_refuse_a_shard):
        assert r["loaded"] <= TOL, r
        assert r["error"] is not None and r["error"].startswith(
            "StateDictLayoutError: model.layers.0.self_attn.q_proj.weight: the state dict "
            "holds a tensor of shape (32, 64), but the parameter is (64, 64) as {tp: shard(0)} "
            "on this mesh."
        ), r["error"]
        assert "Fix: load a checkpoint of this model" in r["error"]
        assert r["unchanged"] == 0.0  # the refused load changed nothing


def test_a_dtensor_of_another_layout_is_redistributed():
    for r in get_world(2).run(tasks.other_values):
        assert r["redistributed"] <= TOL, r
        assert "expected torch.Tensor or Tensor-like object from checkpoint" in r["non_tensor"]


def test_expert_parameters_save_with_their_expert_mesh_layout(tmp_path):
    results = get_world(2).run(tasks.expert_round_trip, str(tmp_path / "ep"))
    for r in results:
        assert r["experts"], r  # the stacked expert projections are DTensors ...
        assert r["meshes"] == {("edp", "ep")}, r  # ... on the derived expert mesh
        assert r["scrambled"] > 0.5  # negative control
        assert r["restored"] <= TOL and r["logits"] <= 1e-5, r
        # Resharded: into one whole model in one process, and that model's checkpoint back
        # into a fresh ep=2 model (negative control: the fresh model differs before).
        assert r["fresh_before"] > 0.01 and r["back"] <= TOL, r
    assert results[0]["single"] <= TOL and results[0]["single_logits"] <= 1e-5, results[0]


def test_reshard_tp2_to_tp4_and_back(tmp_path):
    """Saved at tp=2, loaded at tp=4 (DCP reads the slices each rank needs), saved again at
    tp=4 and loaded back at tp=2: every parameter and the logits equal one device's."""
    at2, at4 = str(tmp_path / "tp2"), str(tmp_path / "tp4")
    assert all(get_world(2).run(tasks.save_at, at2, 2))
    for r in get_world(4).run(tasks.load_at, at2, 4):
        assert r["before"] > 0.01  # negative control: the fresh model's weights differ
        assert r["after"] <= TOL and r["logits"] <= 1e-5, r
    assert all(get_world(4).run(tasks.save_at, at4, 4))
    for r in get_world(2).run(tasks.load_at, at4, 2):
        assert r["after"] <= TOL and r["logits"] <= 1e-5, r
