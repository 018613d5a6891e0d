"""apply(): every preflight error names the culprit and the fix, and leaves the model as it was."""

from __future__ import annotations

import pytest

from hp_core.testing import get_world
from tests import dist_tasks_apply as tasks

pytestmark = pytest.mark.distributed

CASES = {
    "mesh_missing_axis": ("MeshMismatchError", ["lacks ['cp']", "plan again for this mesh"]),
    "mesh_size": ("MeshMismatchError", ["tp: plan 1, mesh 2"]),
    "not_a_mesh": ("MeshMismatchError", ["needs a torch DeviceMesh", "got MeshSpec"]),
    "bad_mode": ("PreflightError", ["mode='fast'", "('production', 'validate')"]),
    "not_a_plan": ("PreflightError", ["expects a ShardingPlan", "got dict"]),
    "unknown_module": ("PreflightError", ["'model.layers.2", "which the model does not have"]),
    "region_dispatch_true": (
        "PreflightError",
        ["model.layers.0.self_attn: region_dispatch=True without an injection"],
    ),
    "injection_without_region_dispatch": (
        "PreflightError",
        ["model.layers.0.self_attn: injected compute must declare region_dispatch"],
    ),
    "target_without_wrapper": ("PreflightError", ["inner_target is set but inner_wrapper is not"]),
    "wrapper_without_target": (
        "PreflightError",
        ["inner_wrapper is set but inner_target is not", "inner_target: self"],
    ),
    "child_without_inner_out_src": (
        "PreflightError",
        ["inner_target 'q_proj' is a child, so inner_out_src must say"],
    ),
    "child_typo": (
        "PreflightError",
        ["inner_target 'q_prj' is not a child module", "Did you mean 'q_proj'?"],
    ),
    "unknown_wrapper_name": ("UnknownRegistryItemError", ["sdpa_hff"]),
    "undecorated_compute": ("InjectionDefinitionError", ["undecorated", "@local_compute"]),
    "compute_signature": (
        "InjectionBindingError",
        ["parameter 0 of the forward is 'x'", "not_hidden_states"],
    ),
    "cp_without_wrapper": (
        "PreflightError",
        [
            "model.layers.0.self_attn: attention under cp=2",
            "hp-plugin-cp",
            'match: "*.self_attn"',
            "when: cp",
            "inner_wrapper: sdpa_hf",
            "region_dispatch: false",
        ],
    ),
    "ep_without_compute": (
        "PreflightError",
        [
            "model.layers.0.mlp: experts are sharded over ep=2",
            "local_compute_fn:",
            "region_dispatch: false",
        ],
    ),
    "attr_mismatch": (
        "PreflightError",
        ["model.layers.0.self_attn.head_dim is 16 but the plan expects 99"],
    ),
    "loss_parallel_without_loss_function": (
        "PreflightError",
        ["loss_parallel needs a model", "_NoLossLM"],
    ),
    "double_apply": ("PreflightError", ["already parallelized"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_preflight_error(case):
    expected_type, fragments = CASES[case]
    for rank, r in enumerate(get_world(2).run(tasks.apply_error, case)):
        assert r["type"] == expected_type, (rank, r)
        for fragment in fragments:
            assert fragment in r["message"], (rank, fragment, r["message"])
        if case != "double_apply":  # that model was applied once on purpose
            assert r["untouched"], (rank, case)


def test_divergent_plans_fail_on_every_rank_instead_of_deadlocking():
    for r in get_world(2).run(tasks.apply_error, "divergent_plan", timeout=60):
        assert r["type"] == "PlanMismatchError"
        assert (
            "ranks hold different plans" in r["message"] and "fingerprints by rank" in r["message"]
        )
        assert r["untouched"]


def test_one_rank_failing_preflight_stops_every_rank():
    r0, r1 = get_world(2).run(tasks.apply_error, "rank_local_failure", timeout=60)
    assert r1["type"] == "PreflightError" and "mode='fast'" in r1["message"]
    assert (
        r0["type"] == "PlanMismatchError" and "failed its preflight on rank(s) [1]" in r0["message"]
    )
    assert r0["untouched"] and r1["untouched"]


# Validate mode keeps head counts global, so only production has an attribute phase.
ROLLBACK_CASES = [
    (phase, mode)
    for phase in ("params", "boundaries", "inner", "attrs", "grad_sync", "loss", "final")
    for mode in ("production", "validate")
    if not (phase == "attrs" and mode == "validate")
]


@pytest.mark.parametrize("phase,mode", ROLLBACK_CASES)
def test_failed_apply_rolls_back(phase, mode):
    for r in get_world(2).run(tasks.rollback, phase, mode):
        assert r["error"] is not None and f"injected failure in {phase}" in r["error"], r["error"]
        assert r["untouched"] and r["same_loss"]
