"""Refusals name the user's code: one mechanical check, its negative controls, and the
refusals of real models run through it.

:func:`hp_core.testing.refusal_check.refusal_problems` is also applied to every refusal of
the differential matrix (tests/test_matrix.py) and of the zoo (tests/test_zoo_equivalence.py).
Its word list is derived from the code (the fields of ``Derived``, the user-facing spec
fields), not written by hand, so a new internal fact is covered the day it is added.
"""

from __future__ import annotations

import pytest
from torch import nn

import hp_core
from hp_core import HpError
from hp_core.spec.derived import Derived
from hp_core.testing.families import build_family
from hp_core.testing.refusal_check import INTERNAL_WORDS, refusal_problems
from hp_core.verifier.advice import NO_FIX, VERIFIED
from tests import _fix_models
from tests import dist_tasks_fused_proof as fused_toys
from tests._qk_norm_helpers import no_qk_norm_scheme  # noqa: F401  (fixture)
from tests._toy_models import WithStrayParameter, fused_qkv_lm

NAMES = ["model.layers.0.mlp", "model.layers.0.mlp.up"]
GOOD = f"model.layers.0.mlp: its input arrives split.\n{VERIFIED}\n  - match: 'x'\n"


def test_the_word_list_is_every_derived_fact():
    assert set(INTERNAL_WORDS) == set(Derived.__dataclass_fields__)
    assert {"fused_layouts", "tp_local_attr_plan", "deferred_bias_params"} <= set(INTERNAL_WORDS)


def test_a_refusal_in_the_users_terms_passes():
    assert refusal_problems(GOOD, NAMES) == []
    no_fix = f"model.layers.0.mlp: its code reads tensor values.\n{NO_FIX}; it tried: ..."
    assert refusal_problems(no_fix, NAMES) == []


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        (GOOD.replace("model.layers.0.mlp", "the MLP"), "it names no module of the model"),
        (
            "model.layers.0.mlp: _fused_layouts disagree.\nFix: keep it whole.",
            "it names hp's internal field(s) ['fused_layouts']",
        ),
        (
            "model.layers.0.mlp: tp_local_attr_plan has no entry.\nFix: keep it whole.",
            "it names hp's internal field(s) ['tp_local_attr_plan']",
        ),
        (
            "model.layers.0.mlp.in_src: 'x' is not a parameter. Name each input as the forward "
            "does.",
            "it names contract field(s) ['in_src'] with no fix",
        ),
        ("model.layers.0.mlp: refused.", "it neither prints a fix nor says why hp has none"),
    ],
    ids=["no-module", "underscore-internal", "internal", "field-without-fix", "no-fix"],
)
def test_negative_controls_each_problem_is_caught(message, problem):
    assert problem in refusal_problems(message, NAMES)


def _refusal(call) -> tuple[str, list[str]]:
    model, run = call()
    with pytest.raises(HpError) as info:
        run(model)
    names = [n for n, _ in model.named_modules() if n] + [n for n, _ in model.named_parameters()]
    return str(info.value), names


def _plan(model: nn.Module, **kw):
    return model, lambda m: hp_core.plan(m, "tp=2", **kw)


def _verified(model: nn.Module, **kw):
    return model, lambda m: hp_core.verify(m, hp_core.plan(m, "tp=2", **kw))


REAL = {
    "position table under SP": lambda: _plan(
        _fix_models.position_table_gpt(), example_inputs=_fix_models.batch(0)
    ),
    "stray parameter": lambda: _plan(WithStrayParameter()),
    "fused q/k/v without head counts": lambda: _plan(fused_qkv_lm()),
    "fused split the proof cannot read": lambda: _plan(
        fused_toys.toy(groups="transpose"), sequence_parallel=False
    ),
    "opt flattens tokens under SP": lambda: _verified(build_family("opt", device="meta")),
    "mpt ALiBi per global head": lambda: _plan(build_family("mpt", device="meta")),
    "gpt_bigcode multi-query": lambda: _plan(build_family("gpt_bigcode", device="meta")),
    "jetmoe routing on meta": lambda: _plan(build_family("jetmoe", device="meta")),
}


@pytest.mark.parametrize("case", sorted(REAL))
def test_real_refusals_name_the_users_module_and_a_checked_fix(case):
    message, names = _refusal(REAL[case])
    assert refusal_problems(message, names) == [], message
    assert VERIFIED in message or NO_FIX in message


@pytest.mark.usefixtures("no_qk_norm_scheme")  # the planner before it sharded such norms
def test_a_verifier_refusal_names_the_users_module_and_a_checked_fix():
    message, names = _refusal(lambda: _verified(build_family("olmo2", device="meta")))
    assert refusal_problems(message, names) == [] and VERIFIED in message, message
