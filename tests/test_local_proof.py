"""The local-program gate: a tp-sharded attention block whose forward would run another
program on its local shards than globally is refused at plan time (validate would match).

The negative control turns the gate off and shows the equivalence check then catching
production training wrong while validate matches: the gate guards a real, silent error.
"""

from __future__ import annotations

import pytest
import torch

import hp_core
from hp_core.testing import check_equivalence, get_world
from tests import _local_proof_models as models
from tests import forward_examples as fe

OWN = "tests._local_proof_models:own_count"
KNOWN = "tests._local_proof_models:known_count"


def _meta(factory):
    with torch.device("meta"):
        return factory()


def test_a_known_head_count_is_made_local_whatever_the_projections_are_called() -> None:
    p = hp_core.plan(_meta(models.known_count), "tp=2")
    block = p["layers.0.block"]
    assert str(block.params["wq.weight"]["tp"]) == "S(0)"
    assert block._tp_local_attr_plan == {"n_head": (4, 2)}


def test_a_head_count_of_its_own_is_found_by_the_search() -> None:
    p = hp_core.plan(_meta(models.own_count), "tp=2")
    assert p["layers.0.block"]._tp_local_attr_plan == {"width_groups": (4, 2)}
    assert p["layers.0.block"].tp_divide_attrs == ["width_groups"]


def test_a_constant_head_count_is_refused_naming_the_block_the_op_and_the_fix() -> None:
    model = _meta(models.constant_count)
    with pytest.raises(hp_core.LocalProgramError) as err:
        hp_core.plan(model, "tp=2")
    msg = str(err.value)
    assert msg.startswith("layers.0.block: ConstantCount's forward")
    assert (
        "after wq: view (1, 4, 32) -> (1, 4, 4, 8) becomes view (1, 4, 16) -> (1, 4, 4, 4)" in msg
    )
    assert "tp_divide_attrs" in msg and "Fix:" in msg
    assert isinstance(err.value, hp_core.HpError)


def test_declaring_the_attribute_plans_it() -> None:
    entry = {"match": "layers.0.block", "tp_divide_attrs": ["width_groups"]}
    p = hp_core.plan(_meta(models.own_count), "tp=2", overrides=[entry])
    assert p["layers.0.block"]._tp_local_attr_plan == {"width_groups": (4, 2)}


def test_a_forward_that_does_not_run_on_meta_is_left_to_the_verifier() -> None:
    p = hp_core.plan(_meta(models.not_on_meta), "tp=2")
    assert str(p["layers.0.block"].params["q_proj.weight"]["tp"]) == "S(0)"


def test_without_tp_nothing_is_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("traced")

    monkeypatch.setattr("hp_core.planner.local_proof._capture", boom)
    hp_core.plan(_meta(models.own_count), "cp=2")


def test_known_and_declared_counts_match_one_device_in_both_modes() -> None:
    world = get_world(2)
    report = check_equivalence(KNOWN, fe.batch, "tp=2", loss_fn=fe.loss, world=world)
    assert report.worst["production:logits"] <= 1e-5 and report.worst["validate:grad"] <= 1e-5
    entry = {"match": "layers.0.block", "tp_divide_attrs": ["width_groups"]}
    report = check_equivalence(
        OWN, fe.batch, "tp=2", overrides=[entry], loss_fn=fe.loss, world=world
    )
    assert report.worst["production:grad"] <= 1e-5


def test_negative_control_without_the_gate_production_alone_trains_wrong() -> None:
    """With the gate switched off on the ranks, validate matches one device and production
    does not: exactly the silent error the gate refuses at plan time."""
    worst = get_world(2).run(models.ungated_equivalence)[0]
    assert worst["validate:logits"] <= 1e-5 and worst["validate:grad"] <= 1e-5
    assert worst["production:logits"] > 1e-3
