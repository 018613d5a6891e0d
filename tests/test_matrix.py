"""The differential matrix: many Hugging Face families at tp=2, sequence parallel on and off.

Each family either matches a single device — loss, logits and every gradient over 2 AdamW
steps, production and validate, rtol/atol 1e-5, the optimizer really moving every weight —
or is refused with a clear error (an ``HpError`` naming a module of the model) before any
collective: planning is local, and verification issues none. A refusal that proposes an
override is followed (the override applied, the case run again) until it matches or is
refused without a further proposal: following hp's advice never gives a wrong result.
"""

from __future__ import annotations

import pytest

from hp_core.testing import get_world
from hp_core.testing.families import FAMILY_NAMES
from tests import dist_tasks_matrix as tasks

pytestmark = pytest.mark.distributed
TOL = 1e-5


def check(r: dict) -> str:
    """'matched' or 'refused'; asserts everything else."""
    for step in r["rounds"][:-1]:  # every intermediate refusal proposed the fix that was tried next
        assert step.get("refused") and step["names_module"], step
    if "refused" in r:
        assert r["names_module"], f"the refusal names no module of the model: {r['message'][:300]}"
        assert r["type"].endswith("Error")
        if r["refused"] == "verify":
            assert r["collectives"] == 0, "the verifier issued a collective"
        return "refused"
    assert "caught" not in r, r
    bad = {k: v for k, v in r["excess"].items() if not v <= TOL}
    assert not bad, f"mismatches above {TOL}: {bad}"
    assert r["n_grads"] > 0 and all(v > 0 for v in r["moved"].values()), r["moved"]
    assert r["collectives"] == 0, "the verifier issued a collective"
    return "matched"


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_matches_or_is_refused_clearly(family, sp):
    results = get_world(2).run(tasks.family_case, family, sp)
    outcomes = {check(r) for r in results}
    assert len(outcomes) == 1, "ranks disagree"


REQUIRED_TO_MATCH = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "gemma", "gemma2", "gemma3"]


@pytest.mark.parametrize("family", REQUIRED_TO_MATCH)
def test_these_families_match_without_help(family):
    """The first families the issue lists: no refusal, no fix needed."""
    r = get_world(2).run(tasks.family_case, family, True)[0]
    assert len(r["rounds"]) == 1 and check(r) == "matched"


@pytest.mark.parametrize("control", ["no_reductions", "lie_about_input"])
def test_negative_controls_are_caught_in_both_modes(control):
    """A runtime that forgets the derived gradient sums, or a plan that lies about an input's
    layout, must be caught — by the comparison, validate's own checks, or the verifier."""
    for r in get_world(2).run(tasks.family_case, "llama", True, control):
        assert r.get("caught") or r.get("refused"), r
