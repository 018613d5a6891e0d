"""A refusal prints only a fix hp planned and verified; followed, the fix matches one device.

The case the issue found: a learned position table no template claims is refused with the
fix "keep it whole, its module not wrapped". With sequence parallelism on that fix plans —
and then the whole table meets a sequence shard of the token embeddings. hp must find that
before printing: the fix it prints turns sequence parallelism off as well, and following it
trains like one device. The negative control plans the unsound fix alone and shows the
verifier refusing it (so the check is what stops it being printed).
"""

from __future__ import annotations

import pytest
import torch

import hp_core
from hp_core import HpError
from hp_core.planner.lints import FusedProjectionError
from hp_core.planner.structure import UncoveredParameterError
from hp_core.plans.proposal import Proposal, propose
from hp_core.testing import check_equivalence, get_world
from hp_core.testing.families import build_family
from hp_core.testing.printed_fix import printed_fix
from hp_core.verifier.advice import SP_OFF, VERIFIED
from tests import _fix_models
from tests._qk_norm_helpers import no_qk_norm_scheme  # noqa: F401  (fixture)
from tests._toy_models import head_attention_lm

TABLE_KEPT_WHOLE = [{"match": "", "is_boundary": False, "params": {"pos_emb": {"tp": "replicate"}}}]


def _refusal(**kw) -> HpError:
    with pytest.raises(UncoveredParameterError) as info:
        hp_core.plan(
            _fix_models.position_table_gpt(), "tp=2", example_inputs=_fix_models.batch(0), **kw
        )
    return info.value


def test_the_position_table_fix_is_printed_with_sequence_parallel_off():
    message = str(_refusal(sequence_parallel=True))
    assert "pos_emb (replicated, shape (32, 64))" in message
    fix = printed_fix(message)
    assert fix is not None, message
    assert fix.overrides == TABLE_KEPT_WHOLE and fix.flags == {"sequence_parallel": False}
    assert message.rstrip().endswith(f"and {SP_OFF}")
    # without sequence parallelism the same entry alone holds, and is what is printed
    alone = printed_fix(str(_refusal(sequence_parallel=False)))
    assert alone is not None and alone.overrides == TABLE_KEPT_WHOLE and alone.flags == {}


def test_negative_control_the_entry_alone_under_sequence_parallel_does_not_verify():
    """What hp printed before it checked its fixes: it plans, and the verifier refuses it."""
    model = _fix_models.position_table_gpt()
    p = hp_core.plan(model, "tp=2", overrides=TABLE_KEPT_WHOLE, example_inputs=_fix_models.batch(0))
    with pytest.raises(HpError, match=r"pos_emb|drop|sequence"):
        hp_core.verify(model, p)


def test_following_the_printed_fix_matches_one_device():
    fix = printed_fix(str(_refusal(sequence_parallel=True)))
    assert fix is not None
    report = check_equivalence(
        _fix_models.position_table_gpt,
        _fix_models.batch,
        "tp=2",
        overrides=fix.overrides,
        plan_kwargs={**fix.flags, "example_inputs": _fix_models.batch(0)},
        loss_fn=_fix_models.loss,
        world=get_world(2),
        steps=3,
    )
    assert report.worst["production:grad"] <= 1e-5 and report.worst["validate:grad"] <= 1e-5
    assert report.compared["production:grad"] == report.n_params


@pytest.mark.usefixtures("no_qk_norm_scheme")  # the planner before it sharded such norms
def test_a_refusal_of_a_plan_hp_did_not_make_prints_no_fix():
    """A loaded (or edited) plan cannot be planned again: hp says so instead of a fix."""
    model = build_family("olmo2", device="meta")  # full-width q/k norms on sharded q/k
    made = hp_core.plan(model, "tp=2")
    with pytest.raises(HpError) as checked:
        hp_core.verify(model, made)
    assert printed_fix(str(checked.value)) is not None
    loaded = hp_core.load_plan(hp_core.dump_plan(made))
    edited = made.copy()
    edited.modules["model.norm"].params = dict(edited.modules["model.norm"].params)
    edited.sequence_parallel = not made.sequence_parallel
    for p in (loaded, edited):
        with pytest.raises(HpError) as info:
            hp_core.verify(model, p)
        message = str(info.value)
        assert printed_fix(message) is None, message
        assert "hp cannot plan the model again to check a fix" in message


def test_a_fix_that_meets_a_second_refusal_is_printed_with_that_refusals_fix(monkeypatch):
    """Two rounds: the first fix plans into a refusal of its own, whose fix completes it."""
    import hp_core.verifier.advice as advice

    real = advice.plan_model
    first = Proposal("  - match: 'a'", "fix a", flags={"loss_parallel": False})
    second = Proposal("  - match: 'b'", "fix b", flags={"ep_size": 1})

    calls: list[dict] = []

    def counting(model, mesh, **kw):
        calls.append(kw)
        if len(calls) == 1:
            raise propose(FusedProjectionError("model.x: refused"), first)
        if len(calls) == 2:  # the first fix, tried: a second refusal with its own fix
            raise propose(FusedProjectionError("model.y: refused"), second)
        return real(model, mesh, **kw)

    monkeypatch.setattr(advice, "plan_model", counting)
    with pytest.raises(FusedProjectionError) as info:
        advice.plan(head_attention_lm(1), "tp=2", sequence_parallel=False)
    message = str(info.value)
    assert f"{VERIFIED}\n  - match: 'a'\n  - match: 'b'" in message, message
    assert len(calls) == 3 and calls[2]["ep_size"] == 1


def test_printed_fix_reads_nothing_from_a_message_without_one():
    assert printed_fix("model.x: refused.\nFix: keep it whole.") is None
    with pytest.raises(ValueError, match="not a list of override entries"):
        printed_fix(f"x\n{VERIFIED}\n  match: 'a'\n")


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
