"""The zoo (tests/zoo: hand-written models in the style of five pure-PyTorch projects) at tp=2,
sequence parallel on and off, both modes, against one device.

Every entry is planned on its training call (``example_inputs``) with no other help. The
outcome is asserted per entry (:data:`EXPECTED`): it matches one device, or it is refused
with the expected error naming the model's own module and printing a fix; that fix, pasted
as the user would paste it (and the next one it leads to), then plans, verifies and
matches. Where attention ends up tp-sharded or kept whole is asserted too, so a change in
what hp can shard shows here.
"""

from __future__ import annotations

import pytest

import hp_core
from hp_core import HpError
from hp_core.testing import check_equivalence, get_world
from tests.zoo.survey import ENTRIES, MESH, Entry, block_layout, suggested_overrides

ZOO = {e.name: e for e in ENTRIES if e.name != "mingpt_copyable"}

#: entry -> (zero-config outcome: "match" or the refusal's class, attention after it all)
EXPECTED: dict[str, tuple[str, str]] = {
    "nanogpt": ("match", "sharded"),
    "gpt_fast": ("match", "sharded"),
    "torchtitan_llama": ("match", "sharded"),
    "litgpt_llama": ("match", "sharded"),
    "litgpt_pythia": ("match", "sharded"),
    "litgpt_phi": ("match", "sharded"),
    "mingpt": ("match", "sharded"),
}
MAX_FIXES = 6


def _plan(entry: Entry, sp: bool, overrides: list[dict]) -> hp_core.ShardingPlan:
    return hp_core.plan(
        entry.factory(),
        MESH,
        sequence_parallel=sp,
        overrides=overrides or None,
        example_inputs=entry.batch(0),
    )


def _followed(entry: Entry, sp: bool, first: HpError) -> tuple[hp_core.ShardingPlan, list]:
    """Paste the refusal's printed fix, and the next refusal's, until the model plans."""
    overrides: list[dict] = []
    err: HpError = first
    for _ in range(MAX_FIXES):
        more = [o for o in suggested_overrides(str(err)) if o not in overrides]
        assert more, f"{entry.name}: a refusal prints no fix to paste:\n{err}"
        overrides += more
        try:
            return _plan(entry, sp, overrides), overrides
        except HpError as e:
            err = e
    raise AssertionError(f"{entry.name}: fixes kept coming:\n{err}")


def test_every_zoo_entry_has_an_expected_outcome() -> None:
    assert set(EXPECTED) == set(ZOO)


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_entry_matches_or_is_refused_with_a_fix_that_matches(name: str, sp: bool) -> None:
    entry = ZOO[name]
    outcome, attention = EXPECTED[name]
    overrides: list[dict] = []
    try:
        p = _plan(entry, sp, [])
        got = "match"
    except HpError as e:
        got = type(e).__name__
        message = str(e)
        assert entry.attention in message, message  # names the user's module
        assert "Fix" in message, message
        p, overrides = _followed(entry, sp, e)
    assert got == outcome, f"{name}: expected {outcome}, got {got}"
    assert block_layout(p, entry.attention).startswith(attention), block_layout(p, entry.attention)
    report = check_equivalence(
        entry.factory,
        entry.batch,
        MESH,
        overrides=overrides or None,
        plan_kwargs={"sequence_parallel": sp, "example_inputs": entry.batch(0)},
        loss_fn=entry.loss_fn,
        world=get_world(2),
        steps=3,
    )
    assert report.worst["production:grad"] <= 1e-5 and report.worst["validate:grad"] <= 1e-5
    assert report.compared["production:grad"] == report.n_params
