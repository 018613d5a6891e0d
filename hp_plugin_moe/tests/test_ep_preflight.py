"""Preflight errors of expert parallelism: each names the module and the fix, and leaves the
model exactly as it was (real gloo ranks; every rank raises the same error)."""

from __future__ import annotations

import moe_tasks as tasks
import pytest
import yaml

from hp_core import load_overrides
from hp_core.testing import get_world

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def errors() -> dict[str, list[dict]]:
    """Run every case once (a world task per case), keyed by case name."""
    cases = [
        "no_compute",
        "no_compute_toy",
        "experts_not_divisible",
        "ep_not_dividing_region",
        "config_typo",
        "bad_config_value",
        "undecorated",
        "wrong_signature",
        "wrong_archetype",
        "replicated_tokens",
        "rollback",
    ]
    w = get_world(2)
    return {case: w.run(tasks.apply_error, case) for case in cases}


def _one(errors: dict, case: str) -> dict:
    first, second = errors[case]
    assert first["type"] is not None, f"{case}: apply did not fail"
    assert first == second, f"{case}: the ranks disagree"
    assert first["unchanged"] and not first["applied"], f"{case}: the model was modified"
    return first


def test_no_compute_suggests_the_registered_factory_as_yaml(errors):
    e = _one(errors, "no_compute")
    assert e["type"] == "PreflightError"
    msg = e["message"]
    assert msg.startswith(
        "model.layers.0.mlp: experts are sharded over ep=2 but no compute is declared"
    )
    assert "the factory registered for Qwen2MoeForCausalLM" in msg
    snippet = msg.split("Add:\n", 1)[1].split("\n(", 1)[0]
    entries = yaml.safe_load(snippet)
    assert entries == [
        {"match": "model.layers.*.mlp", "local_compute_fn": "qwen2moe", "region_dispatch": False}
    ]
    assert load_overrides(snippet)  # a valid overrides document as is


def test_no_compute_for_an_unknown_architecture_says_what_to_write(errors):
    msg = _one(errors, "no_compute_toy")["message"]
    assert "local_compute_fn: FACTORY" in msg
    assert "no installed plugin registers a factory for ToyMoELM" in msg


def test_expert_count_not_divisible_by_ep(errors):
    e = _one(errors, "experts_not_divisible")
    assert e["type"] == "PreflightError"
    assert (
        "model.layers.0.mlp.params.experts.gate_up_proj.ep: dim 0 of shape (3, 64, 64) has size "
        "3, which ep=2 does not divide" in e["message"]
    )


def test_ep_size_must_divide_the_dense_region(errors):
    e = _one(errors, "ep_not_dividing_region")
    assert e["type"] == "ExpertParallelError" and "PreflightError" in e["mro"]
    assert e["message"].startswith(
        "model.layers.0.mlp: ep_size=4 does not divide the dense region's 2 ranks (mesh tp=2)"
    )
    assert "Plan with ep_size in [2]" in e["message"]


def test_factory_config_key_typo(errors):
    e = _one(errors, "config_typo")
    assert e["type"] == "InjectionBindingError"
    assert e["message"].startswith(
        "plan['model.layers.0.mlp'].local_compute_fn: unknown config key 'capacity_factr'"
    )
    assert "Did you mean 'capacity_factor'?" in e["message"]
    assert "Valid config keys: ['capacity_factor', 'router']" in e["message"]


def test_factory_config_value_is_checked_when_bound(errors):
    e = _one(errors, "bad_config_value")
    assert e["type"] == "PreflightError" and e["cause"] == "MoEConfigError"
    assert e["message"].startswith(
        "model.layers.0.mlp: the @local_compute factory 'qwen2moe' refused this module:"
    )
    assert "capacity_factor must be a positive number" in e["message"]


def test_factory_without_the_decorator(errors):
    e = _one(errors, "undecorated")
    assert e["type"] == "InjectionDefinitionError"
    assert (
        "moe_tasks.not_decorated (from plan['model.layers.0.mlp'].local_compute_fn) is not "
        "decorated with @local_compute" in e["message"]
    )


def test_compute_whose_parameters_do_not_match_the_forward(errors):
    e = _one(errors, "wrong_signature")
    assert e["type"] == "InjectionBindingError"
    assert (
        "cannot stand in for forward(hidden_states: torch.Tensor) -> torch.Tensor" in e["message"]
    )
    assert "parameter 0 of the forward is 'hidden_states', the replacement has 'x'" in e["message"]


def test_factory_for_the_wrong_archetype_lists_the_real_children(errors):
    e = _one(errors, "wrong_archetype")
    assert e["type"] == "PreflightError" and e["cause"] == "MoEInterfaceError"
    msg = e["message"]
    assert msg.startswith(
        "model.layers.0.mlp: the @local_compute factory 'mixtral' refused this module: mixtral "
        "cannot drive Qwen2MoeSparseMoeBlock"
    )
    assert (
        "children: gate (Qwen2MoeTopKRouter), experts (Qwen2MoeExperts), shared_expert "
        "(Qwen2MoeMLP), shared_expert_gate (Linear)" in msg
    )
    assert "experts.gate_up_proj (4, 64, 64)" in msg
    assert "Fix: use local_compute_fn: qwen2moe." in msg


def test_expert_group_over_replicated_tokens(errors):
    e = _one(errors, "replicated_tokens")
    assert e["message"].startswith(
        "model.layers.0.mlp: the expert group of ep=2 spans the 'tp' axis"
    )
    assert "every token would reach its experts 2 times" in e["message"]


def test_failure_after_stacking_rolls_everything_back(errors):
    e = _one(errors, "rollback")
    assert e["type"] == "ApplyFailedError" and "RuntimeError: boom" in e["message"], e["message"]
    assert (
        "model.layers.0.post_attention_layernorm" in e["message"]
        and "restored its model" in e["message"]
    )
