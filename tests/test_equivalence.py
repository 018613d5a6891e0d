"""The one-call equivalence check (issue 15, item 1): it passes a correct parallelization,
catches a production-only error and a gradient-only error, and refuses bad input.

Every check runs on the one shared 2-rank gloo world; the factories live in
``tests/_equivalence_models.py`` and the negative-control hooks in
``tests/dist_tasks_equivalence.py``, both importable by the spawned ranks.
"""

from __future__ import annotations

import math
import pickle

import pytest

from hp_core import HpError
from hp_core.testing import (
    EquivalenceArgumentError,
    EquivalenceBatchError,
    EquivalenceError,
    EquivalenceFactoryError,
    EquivalenceMeshError,
    EquivalenceOutputError,
    EquivalenceReport,
    EquivalenceRunError,
    WorldTaskError,
    check_equivalence,
    get_world,
)
from hp_core.testing.families import build_family
from hp_core.verifier.errors import ProductionDiffersError
from hp_plugin_cp import HF_CP_OVERRIDES, cp_global_loss, cp_shard_batch
from tests import _equivalence_models as models
from tests import dist_tasks_equivalence as tasks

M = "tests._equivalence_models:"
MODES_AND_PAIR = ("production", "validate", "production-validate")


def _assert_passed(report: EquivalenceReport) -> None:
    assert report.passed, report.summary()
    assert report.worst, "nothing was compared"
    for key, excess in report.worst.items():
        assert math.isfinite(excess) and excess <= report.atol, (key, excess)


def test_llama_tp2_sequence_parallel_passes_and_compares_every_gradient():
    report = check_equivalence(
        models.llama, M + "llama_batch", "tp=2", plan_kwargs={"sequence_parallel": True}
    )
    _assert_passed(report)
    n_params = sum(1 for _ in build_family("llama", seed=0).named_parameters())
    assert report.n_params == n_params
    for mode in MODES_AND_PAIR:
        for quantity in ("loss", "logits", "grad", "param"):
            assert f"{mode}:{quantity}" in report.worst, (mode, quantity)
        assert report.compared[f"{mode}:grad"] == n_params
        assert report.compared[f"{mode}:param"] == n_params
    assert report.compared["production:moved"] == n_params
    copy = pickle.loads(pickle.dumps(report))
    assert copy.worst == report.worst
    summary = report.summary()
    for mode in MODES_AND_PAIR:
        assert f"{mode}:grad" in summary
    assert "FAILED" not in summary


def test_plain_tensor_output_with_loss_fn_passes():
    report = check_equivalence(
        M + "titan_logits", models.titan_batch, {"tp": 2}, loss_fn=models.next_token_loss
    )
    _assert_passed(report)
    assert report.compared["production:logits"] == 1
    assert report.compared["validate:grad"] == report.n_params > 0


def test_loss_parallel_logits_are_gathered_by_the_plans_output_layout():
    report = check_equivalence(
        M + "llama", M + "llama_batch", "tp=2", plan_kwargs={"loss_parallel": True}, steps=1
    )
    _assert_passed(report)
    logits = report.findings["production:logits"][0]
    assert logits.placements == "tp: Shard(2)"


def test_context_parallel_with_the_cp_training_adapter_split():
    # the cp plugin's batch split and global loss, through the documented hooks
    report = check_equivalence(
        models.llama,
        models.llama_batch,
        "cp=2",
        overrides=HF_CP_OVERRIDES,
        shard_batch=cp_shard_batch,
        after_apply=cp_global_loss,
        steps=1,
    )
    _assert_passed(report)
    assert report.findings["production:logits"][0].placements == "cp: Shard(1)"
    assert report.compared["validate:grad"] == report.n_params


#: The per-expert ModuleList toy at ep=2 with hp-plugin-moe's routed-only compute.
LIST_MOE_EP = {
    "overrides": models.LIST_MOE_OVERRIDES,
    "plan_kwargs": {"ep_size": 2},
    "loss_fn": models.next_token_loss,
}


def test_stacked_experts_compare_against_the_per_expert_reference():
    """ep=2 stacks the toy's per-expert ModuleList into ``experts.w1.weight`` [E, ...]; the
    reference keeps ``experts.<i>.w1.weight``. Every stacked gradient and parameter is
    compared with the reference's experts stacked in expert order."""
    report = check_equivalence(M + "list_moe", M + "list_moe_batch", "tp=2", **LIST_MOE_EP)
    _assert_passed(report)
    per_expert = sum(1 for n, _ in models.list_moe().named_parameters() if ".experts." in n)
    # 2 layers x 3 projections stacked: the parallel model's names, each compared
    assert report.n_params == sum(1 for _ in models.list_moe().parameters()) - per_expert + 6
    for mode in MODES_AND_PAIR:
        assert report.compared[f"{mode}:grad"] == report.n_params
        assert report.compared[f"{mode}:param"] == report.n_params


def test_stacked_experts_in_the_wrong_order_fail_in_production_only():
    """Negative control: production's stacked experts 0 and 1 swapped after apply."""
    with pytest.raises(EquivalenceError) as err:
        check_equivalence(
            M + "list_moe",
            M + "list_moe_batch",
            "tp=2",
            **LIST_MOE_EP,
            after_apply=models.swap_two_experts,
            steps=1,
        )
    failed = err.value.report.failed()
    assert "production:grad" in failed and not [k for k in failed if k.startswith("validate")]
    found = {f.name: f for f in err.value.report.findings["production:grad"]}
    swapped = found["model.layers.0.block_sparse_moe.experts.w1.weight"]
    assert swapped.excess > 0 and "ep" in swapped.placements, swapped


def test_gpt2_fused_c_attn_passes_with_its_fused_layout():
    report = check_equivalence(M + "gpt2", M + "gpt2_batch", "tp=2", steps=1)
    _assert_passed(report)
    c_attn = [f for f in report.findings["production:grad"] if f.name.endswith("c_attn.weight")]
    assert c_attn and "fused ['q', 'k', 'v']" in c_attn[0].placements


def test_fused_c_attn_split_as_plain_rows_is_refused_before_training():
    """Forgetting the fused layouts (c_attn split as plain rows) fails gpt2's own code on the
    local shards while the unsharded model runs it: the verifier refuses it before a step."""
    with pytest.raises(ProductionDiffersError) as info:
        check_equivalence(
            M + "gpt2",
            M + "gpt2_batch",
            "tp=2",
            modes=("production",),
            steps=1,
            plan_hook=tasks.fused_as_plain_rows,
        )
    message = str(info.value)
    assert message.startswith("transformer.h.0.attn (GPT2Attention): in validate mode"), message
    assert "not a meta-device limitation" in message and "is invalid for input of size" in message


def test_production_computing_another_function_is_caught_in_logits_and_grads():
    with pytest.raises(EquivalenceError) as info:
        check_equivalence(
            M + "gpt2",
            M + "gpt2_batch",
            "tp=2",
            modes=("production",),
            after_apply=tasks.perturb_production_attention,
        )
    report = info.value.report
    message = str(info.value)
    assert message.startswith("production mode, step 0, logits:"), message
    assert report.worst["production:logits"] > report.atol
    assert report.worst["production:grad"] > report.atol
    grad_line = next(line for line in message.splitlines() if line.startswith("production:grad"))
    assert "transformer.h." in grad_line and "[tp: Shard(" in grad_line, grad_line
    assert f"> tolerance atol={report.atol:g}" in message


def test_dropped_gradient_reductions_are_caught():
    with pytest.raises(EquivalenceError) as info:
        check_equivalence(
            M + "gpt2",
            M + "gpt2_batch",
            "tp=2",
            modes=("production",),
            steps=1,
            after_apply=tasks.drop_reductions,
        )
    message = str(info.value)
    first = message.splitlines()[0]
    assert first.startswith("production mode, step 0, grad: transformer.h.0.ln_1.weight"), first
    assert "[tp: Replicate()]" in first and "excess inf" in first
    assert "replicas differ across mesh axis 'tp'" in message
    # validate's own runtime check refuses the unreduced gradient: re-raised as itself
    with pytest.raises(HpError, match=r"transformer\.h\.0\.ln_1\.weight") as refused:
        check_equivalence(
            M + "gpt2",
            M + "gpt2_batch",
            "tp=2",
            modes=("validate",),
            steps=1,
            after_apply=tasks.drop_reductions,
        )
    assert type(refused.value).__name__ == "UnreducedGradientError"


def test_a_mismatch_on_one_rank_only_fails_the_check():
    """Rank 0's run is exact; rank 1's production logits are off: the check still fails."""
    with pytest.raises(EquivalenceError) as err:
        check_equivalence(
            models.llama, M + "llama_batch", "tp=2", after_apply=models.shift_rank1_logits, steps=1
        )
    assert "production" in str(err.value) and "logits" in str(err.value)


def test_rank_side_variant_raises_the_same_error_on_every_rank():
    out = get_world(2).run(tasks.raises_on_rank, M + "gpt2", M + "gpt2_batch")
    assert [o["type"] for o in out] == ["EquivalenceError"] * 2
    assert out[0]["message"] == out[1]["message"]
    assert out[0]["worst"]["production:grad"] == math.inf


def test_failure_message_names_every_part_and_the_error_pickles():
    report = EquivalenceReport("tp=2", ("production", "validate"), 2, 1e-5, 1e-5)
    layouts = {"a.weight": "tp: Shard(0)", "b.weight": "tp: Replicate()", "c.bias": "tp: Shard(0)"}
    report.record("validate:grad", {"a.weight": 1e-7}, 0, layouts)
    report.record("production:grad", {"a.weight": 1e-7, "b.weight": 2e-3}, 0, layouts)
    report.record("production:grad", {"a.weight": 0.84, "c.bias": 0.1}, 1, layouts)
    report.record("production:loss", {"loss": 1e-9}, 1, {"loss": "scalar"})
    err = EquivalenceError(report)
    first, *rest = str(err).splitlines()
    assert first == (
        "production mode, step 1, grad: a.weight [tp: Shard(0)] is off the single-device "
        "reference by excess 0.84 > tolerance atol=1e-05, rtol=1e-05 "
        "(|got - ref| <= atol + rtol*|ref|)."
    )
    assert "mesh tp=2" in rest[0] and "2 step(s)" in rest[0]
    assert rest[1] == (
        "production:grad: worst a.weight [tp: Shard(0)] at step 1: excess 0.84; next worst: "
        "c.bias [tp: Shard(0)] at step 1: excess 0.1; b.weight [tp: Replicate()] at step 0: "
        "excess 0.002"
    )
    assert rest[-1].startswith("Fix: ")
    assert report.failed() == ["production:grad"]
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, EquivalenceError) and str(again) == str(err)
    assert isinstance(err, AssertionError)
    summary = report.summary()
    assert "production:grad" in summary and "FAILED" in summary
    assert "validate:grad" in summary and summary.count("ok") >= 2


# ------------------------------------------------------------------ bad input


def _fix(err: BaseException) -> str:
    text = str(err)
    assert isinstance(err, HpError) and "Fix: " in text, text
    return text


def test_factory_that_does_not_import():
    with pytest.raises(EquivalenceFactoryError) as info:
        check_equivalence("tests._no_such_module:llama", M + "llama_batch", "tp=2")
    assert "'tests._no_such_module:llama' does not import" in _fix(info.value)


def test_factory_that_is_not_callable_or_not_picklable():
    with pytest.raises(EquivalenceFactoryError, match=r"NOT_A_FACTORY.*not a callable"):
        check_equivalence(M + "NOT_A_FACTORY", M + "llama_batch", "tp=2")
    with pytest.raises(EquivalenceFactoryError, match="not picklable") as info:
        check_equivalence(lambda: None, M + "llama_batch", "tp=2")
    _fix(info.value)
    with pytest.raises(EquivalenceFactoryError, match=r"'pkg\.module:function'"):
        check_equivalence("tests._equivalence_models.llama", M + "llama_batch", "tp=2")


def test_model_factory_that_returns_no_module():
    with pytest.raises(EquivalenceFactoryError, match=r"returned dict, not an nn\.Module") as info:
        check_equivalence(M + "not_a_model", M + "llama_batch", "tp=2")
    _fix(info.value)


def test_model_factory_that_builds_other_weights_on_other_ranks():
    with pytest.raises(EquivalenceFactoryError, match=r"other weights on rank\(s\) \[1\]") as info:
        check_equivalence(M + "llama_per_rank", M + "llama_batch", "tp=2")
    _fix(info.value)


def test_batch_factory_without_tensors():
    with pytest.raises(EquivalenceBatchError) as info:
        check_equivalence(M + "llama", M + "no_tensors", "tp=2", modes=("production",))
    assert "no_tensors" in _fix(info.value) and "step 0" in str(info.value)


def test_output_without_loss():
    with pytest.raises(EquivalenceOutputError, match="no scalar loss") as info:
        check_equivalence(M + "titan_logits", M + "titan_batch", "tp=2", modes=("production",))
    _fix(info.value)


def test_a_production_forward_that_raises_names_the_mode_and_step():
    with pytest.raises(EquivalenceRunError) as info:
        check_equivalence(
            M + "llama", M + "llama_batch", "tp=2", after_apply=models.production_forward_fails
        )
    msg = _fix(info.value)
    assert msg.startswith("production mode raised RuntimeError in the forward and loss of step 0")
    assert "injected forward failure" in msg and "rank traceback" in msg
    # the ranks' tracebacks stay reachable: the cause is the world's task error
    assert isinstance(info.value.__cause__, WorldTaskError)
    assert "_equivalence_models.py" in str(info.value.__cause__)  # the hook's frame


def test_a_production_backward_that_raises_names_the_phase():
    with pytest.raises(
        EquivalenceRunError,
        match="production mode raised RuntimeError in the "
        "backward of step 0: injected backward failure",
    ):
        check_equivalence(
            M + "titan_logits",
            M + "titan_batch",
            "tp=2",
            loss_fn=models.next_token_loss,
            after_apply=models.production_backward_fails,
            modes=("production",),
        )


def test_a_reference_that_raises_says_the_model_itself_fails():
    with pytest.raises(EquivalenceRunError) as info:
        check_equivalence(M + "llama", M + "float_ids", "tp=2", modes=("production",))
    msg = _fix(info.value)
    assert msg.startswith("the single-device reference raised RuntimeError in the forward")
    assert "run it unsharded first" in msg


def test_mesh_whose_size_is_not_the_worlds():
    with pytest.raises(EquivalenceMeshError) as info:
        check_equivalence(M + "llama", M + "llama_batch", "tp=4", world=get_world(2))
    assert "'tp=4' has 4 ranks but the world has 2" in _fix(info.value)


def test_steps_and_modes_out_of_range():
    with pytest.raises(EquivalenceArgumentError, match="steps=0") as info:
        check_equivalence(M + "llama", M + "llama_batch", "tp=2", steps=0)
    _fix(info.value)
    with pytest.raises(EquivalenceArgumentError, match="modes="):
        check_equivalence(M + "llama", M + "llama_batch", "tp=2", modes=("prod",))


def test_plan_refusal_is_reraised_as_itself():
    bad = [{"match": "model.layers.0.self_attn", "params": {"q_proj.weight": {"xp": "shard(0)"}}}]
    with pytest.raises(HpError) as info:
        check_equivalence(M + "llama", M + "llama_batch", "tp=2", overrides=bad)
    assert not isinstance(info.value, WorldTaskError)
    assert "xp" in str(info.value)
