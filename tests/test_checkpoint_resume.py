"""Training resumes from a DCP checkpoint of model + optimizer, on another layout.

A run is 6 AdamW steps on fixed batches; the interrupted runs save after step 3 with
``get_model_state_dict`` + ``get_optimizer_state_dict`` + ``dcp.save`` and a fresh model
and optimizer (other seed) resume with ``dcp.load`` + ``set_*_state_dict``, nothing else.
Losses of steps 4-6, every final parameter and the AdamW moments at the resume match the
uninterrupted single-device run. The models are fp64 (see ``tasks._build``), so the
tolerance is tight: ``TOL`` relative (``max|a - b| / max|b|``); measured ~1e-14.
"""

from __future__ import annotations

import pytest
import torch

import hp_core
from hp_core.testing import get_world
from hp_core.testing.families import build_family
from tests import dist_tasks_resume as tasks
from tests import dist_tasks_resume_fsdp as fsdp_tasks
from tests import dist_tasks_resume_layouts as layout_tasks

pytestmark = pytest.mark.distributed

TOL = 1e-10


def _matches(r: dict) -> None:
    assert r["moments_before"] > 0.5, r  # negative control: the fresh optimizer's state differs
    assert r["moments"] <= TOL and r["losses"] <= TOL and r["params"] <= TOL, r


@pytest.fixture(scope="module")
def tp2_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    prod, val = str(root / "tp2-production"), str(root / "tp2-validate")
    saved = get_world(2).run(tasks.save_tp2, prod, val)
    return prod, val, str(root / "tp4"), saved


def test_fsdp2_on_dp_resumes_at_tp4_in_one_process_and_from_tp2(tp2_checkpoints, tmp_path):
    """dp=2 x tp=2 under FSDP2: the moments are FSDP's DTensors of hp's shards, saved over dp
    and tp together; the checkpoint resumes under FSDP2, at tp=4 and in one process, and a
    tp=2 checkpoint resumes under FSDP2."""
    prod, *_ = tp2_checkpoints
    path = str(tmp_path / "fsdp")
    for r in get_world(4).run(fsdp_tasks.fsdp_save_and_resume, path, prod):
        assert r["losses"] <= TOL and r["moments"] <= TOL, r
        _matches(r["resumed"])
        _matches(r["from_tp2"])
    for r in get_world(4).run(tasks.resume_at_tp, [path], 4, None):
        _matches(r[path])
    single = get_world(2).run(tasks.resume_one_process, path)[0]
    assert single is not None
    _matches(single)


def test_steps_before_the_save_match_one_device(tp2_checkpoints):
    *_, saved = tp2_checkpoints
    for r in saved:
        for mode in ("production", "validate"):
            assert r[f"{mode}_losses"] <= TOL and r[f"{mode}_moments"] <= TOL, r
        # Production's moments of sharded parameters are saved as DTensors; the step stays
        # a plain scalar (identical on every rank).
        assert r["saved_types"] == {"DTensor"} and r["step_type"] == "Tensor", r


def test_tp2_resumes_at_tp4_then_tp2_and_in_one_process(tp2_checkpoints):
    """tp=2 (production and validate) → tp=4 production; tp=4 → tp=2; tp=2 → one plain
    process (``no_dist=True``, a plain AdamW)."""
    prod, val, tp4, _ = tp2_checkpoints
    for r in get_world(4).run(tasks.resume_at_tp, [prod, val], 4, tp4):
        _matches(r[prod])
        _matches(r[val])  # a validate-mode checkpoint resumes in production
    for r in get_world(2).run(tasks.resume_at_tp, [tp4], 2, None):
        _matches(r[tp4])
    single = get_world(2).run(tasks.resume_one_process, prod)[0]
    assert single is not None
    _matches(single)


def test_cp_x_tp_resumes_at_tp2_and_in_one_process(tmp_path):
    path = str(tmp_path / "cp2xtp2")
    for r in get_world(4).run(tasks.save_cp_tp, path):
        assert r["losses"] <= 1e-6 and r["moments"] <= TOL, r  # the cp loss sums in fp32
        assert r["mesh"] == ("cp", "tp"), r  # replicated over cp, sharded over tp
    for r in get_world(2).run(tasks.resume_at_tp, [path], 2, None):
        _matches(r[path])
    single = get_world(2).run(tasks.resume_one_process, path)[0]
    assert single is not None
    _matches(single)


def test_expert_parallel_resume_matches_the_uninterrupted_run(tmp_path):
    """qwen2_moe at tp=2 with ep=2, resumed on the same layout (expert layouts of another
    ep size are not resharded)."""
    for r in get_world(2).run(tasks.ep_resume, str(tmp_path / "ep")):
        assert r["expert_mesh"] == ("edp", "ep"), r  # the moments carry the expert mesh
        _matches(r)


@pytest.fixture(scope="module")
def refused():
    return get_world(2).run(tasks.refusals)


def test_an_exp_avg_of_the_wrong_shape_is_refused_and_nothing_loads(refused):
    for r in refused:
        assert r["wrong_shape"] is not None and r["wrong_shape"].startswith(
            "StateDictLayoutError: model.layers.0.self_attn.q_proj.weight (optimizer state "
            "'exp_avg'): the state dict holds a tensor of shape (32, 64), but the parameter "
            "is (64, 64) as {tp: shard(0)} on this mesh."
        ), r["wrong_shape"]
        assert "\nFix: " in r["wrong_shape"]
        assert r["unchanged"] == 0.0 and r["untouched"], r  # no state tensor changed
        assert r["scrambled"] > 0.5, r  # negative control: a state that does load differs


def test_an_optimizer_state_hp_cannot_lay_out_is_refused_on_save(refused):
    for r in refused:
        assert r["unshaped"] is not None and r["unshaped"].startswith(
            "OptimizerStateError: model.embed_tokens.weight (optimizer state 'row_var'): a "
            "tensor of shape (64, 1), neither a scalar nor the local shard's shape (64, 64); "
            "the parameter is (128, 64) as {tp: shard(0)}."
        ), r["unshaped"]
        assert "\nFix: use an optimizer whose per-parameter state" in r["unshaped"]


def test_track_optimizer_refuses_an_optimizer_of_another_model(refused):
    for r in refused:
        assert r["foreign"] is not None and r["foreign"].startswith(
            "OptimizerStateError: hp_core.track_optimizer: the SGD holds none of the "
            "parameters of LlamaForCausalLM."
        ), r["foreign"]
        assert r["foreign_hooks"] == 0, r  # its step attached nothing either ...
        assert r["added_hooks"] == 1, r  # ... until add_param_group gave it the model's


def test_track_optimizer_refuses_a_model_hp_did_not_apply():
    model = build_family("llama", seed=0)
    with pytest.raises(hp_core.HpError) as e:
        hp_core.track_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert type(e.value).__name__ == "NotAppliedError"
    assert str(e.value).startswith(
        "hp_core.track_optimizer: LlamaForCausalLM was not parallelized by hp"
    )
    assert "\nFix: pass the module you gave to hp_core.apply" in str(e.value)


def test_track_optimizer_then_plain_state_dict_round_trips():
    for r in get_world(2).run(tasks.track_round_trip):
        assert r["kinds"] == {"DTensor", "Tensor"}, r  # sharded moments, plain steps/norms
        assert r["hooks"] == [1, 1], r  # idempotent: tracked twice, hooked once
        assert r["after"] == [0.0, 0.0], r  # DTensor and full-tensor states, 3 more steps
        assert r["validate_hooks"] == 0, r  # validate's states are DTensors already


def test_a_full_optimizer_state_dict_round_trips():
    for r in get_world(2).run(tasks.full_state_dict_round_trip):
        assert r["kinds"] == {"Tensor"} and r["shape"] == (64, 64), r  # whole, not a shard
        assert r["after"] == 0.0, r


def test_models_and_optimizers_are_not_kept_alive():
    for r in get_world(2).run(tasks.models_are_not_kept_alive):
        assert r["model"] and r["optimizer"], r
        assert r["kinds"] == {"Tensor"}, r  # the model is gone: its layouts with it


def test_other_parameter_groups_get_torchs_own_error(refused):
    for r in refused:
        assert r["groups"] == "loaded state dict has a different number of parameter groups"


def test_a_tp2_checkpoint_resumes_at_cp2_x_tp2(tp2_checkpoints):
    """Back into a context-parallel layout: steps 4-6 at cp=2 x tp=2 match one device."""
    prod, *_ = tp2_checkpoints
    for r in get_world(4).run(layout_tasks.resume_at_cp_tp, prod):
        assert r["moments_before"] > 0.5, r
        assert r["moments"] <= TOL and r["params"] <= TOL, r
        assert r["losses"] <= 1e-6, r  # the cp loss sums in fp32


def test_expert_parallel_model_and_optimizer_move_to_one_process_and_back(tmp_path):
    results = get_world(2).run(
        layout_tasks.expert_state_to_one_process_and_back, str(tmp_path / "ep")
    )
    single = results[0]
    assert single["single_before"] > 0.5 and single["single"] <= 1e-6, single
    for r in results:
        assert r["back_before"] > 0.5 and r["back"] <= 1e-6, r
