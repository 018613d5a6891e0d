"""``apply(verify=...)``: the verifier runs inside apply by default; a report may stand in for
it."""

from __future__ import annotations

import pytest

from hp_core.testing import get_world
from tests import dist_tasks_verify as tasks

pytestmark = pytest.mark.distributed


def test_apply_verifies_by_default_and_keeps_the_report():
    for r in get_world(2).run(tasks.apply_keeps_report):
        assert r["partial"] == {
            "model.layers.0.input_layernorm.weight": ["tp"],
            "model.layers.0.post_attention_layernorm.weight": ["tp"],
            "model.norm.weight": ["tp"],
        }
        assert r["same_report"]


@pytest.mark.parametrize(
    "case,error,text",
    [
        ("other_plan", "PreflightError", "the report was made for another plan"),
        ("false", "VerificationRequiredError", "apply(verify=False): the verifier is what derives"),
        (
            "nonsense",
            "PreflightError",
            "apply(verify='yes'): expected True, or a hp_core.VerifyReport",
        ),
        ("refused", "UndeclaredCommunicationError", "model.layers.0.self_attn (Olmo2Attention)"),
    ],
)
def test_apply_refuses_on_every_rank_before_touching_the_model(case, error, text):
    for r in get_world(2).run(tasks.apply_verify_error, case):
        assert r["type"] == error, r
        assert text in r["message"]
        assert r["untouched"]


@pytest.mark.parametrize(
    "case,error,text",
    [
        (
            "undeclared",
            "UndeclaredCommunicationError",
            "model.layers.0.self_attn (Olmo2Attention): in its forward",
        ),
        ("unreduced", "UnreducedGradientError", "a partial sum that no reduction of the plan sums"),
    ],
)
def test_validate_mode_is_an_oracle_of_its_own(case, error, text):
    for r in get_world(2).run(tasks.validate_catches_what_a_wrong_report_lets_through, case):
        assert r["type"] == error and text in r["message"], r
