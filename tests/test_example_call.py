"""The training call: ``plan(example_inputs=...)`` / ``hp plan --example`` is traced, recorded
in the plan and verified at apply; without it hp's default call is named, and a forward that
needs more than it gives is refused naming the argument and the fix (docs/plans.md).

``TargetsLM`` (nanoGPT's ``targets`` branch) is the differential: planned on hp's default call
it follows the last-position path and is refused at apply with sequence parallelism; planned on
the training call it matches one device. ``PositionsLM`` (gpt-fast's ``input_pos``) cannot be
planned without the call at all.
"""

from __future__ import annotations

import pytest
import torch

import hp_core
from hp_core import cli
from hp_core.plans import dump_plan, load_plan, plan_from_dict, plan_to_dict
from hp_core.plans.errors import PlanError, PlanYAMLError
from hp_core.plans.example import (
    ExampleCall,
    ExampleCallError,
    TensorSpec,
    check_call,
    default_call,
    example_call,
    left_out_note,
    parse_example_texts,
)
from hp_core.testing import check_equivalence, get_world
from hp_core.testing.families import build_family
from hp_core.verifier.inputs import example_inputs, verification_mesh
from tests import _example_call_models as models

TARGETS = "tests._example_call_models:targets_lm"
POSITIONS = "tests._example_call_models:positions_lm"
IDS = torch.zeros(2, 8, dtype=torch.long)
LONG28 = TensorSpec((2, 8), torch.long)


def _meta(factory):
    with torch.device("meta"):
        return factory()


# -- recording the call -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("inputs", "args", "kwargs"),
    [
        (IDS, (LONG28,), {}),
        ((IDS, IDS), (LONG28, LONG28), {}),
        ([IDS], (LONG28,), {}),
        ({"idx": IDS, "flag": True}, (), {"idx": LONG28, "flag": True}),
        (((IDS,), {"targets": IDS, "n": None}), (LONG28,), {"targets": LONG28, "n": None}),
    ],
)
def test_every_form_of_the_call_is_recorded_by_shape_and_dtype(inputs, args, kwargs) -> None:
    call = example_call(inputs)
    assert (call.args, dict(call.kwargs), call.given) == (args, kwargs, True)
    assert example_call(call) is call
    meta_args, meta_kwargs = call.meta()
    assert all(a.device.type == "meta" and a.shape == (2, 8) for a in meta_args)
    assert meta_kwargs.keys() == kwargs.keys()


def test_the_call_prints_saves_and_parses_as_one_text() -> None:
    call = example_call(((IDS,), {"targets": IDS.float(), "use_cache": False}))
    assert call.describe() == "forward(int64[2, 8], targets=float32[2, 8], use_cache=False)"
    assert call.texts() == ["int64[2, 8]", "targets=float32[2, 8]", "use_cache=False"]
    assert ExampleCall.from_data(call.to_data(), "example", PlanYAMLError) == call
    parsed = parse_example_texts(["int64[2,8]", "targets=float32[2, 8]", "use_cache=false"])
    assert parsed == call
    assert parse_example_texts(["n=3", "m=none"]).kwargs == {"n": 3, "m": None}


@pytest.mark.parametrize(
    ("make", "culprit"),
    [
        (lambda: example_call({1, 2}), "got set"),
        (lambda: example_call({1: IDS}), "keyword 1 is not an argument name"),
        (lambda: example_call([[1]]), "positional argument 0 is a list"),
        (lambda: example_call({"x": "text"}), "argument 'x' is a str"),
        (lambda: parse_example_texts(["x=int64[2]", "int64[2]"]), "positional argument after"),
        (lambda: parse_example_texts(["int65[2]"]), "'int65[2]' is not a tensor"),
        (lambda: parse_example_texts(["size[2]"]), "'size[2]' is not a tensor"),
        (lambda: parse_example_texts(["1x=int64[2]"]), "must be Python identifiers"),
    ],
)
def test_a_call_hp_cannot_record_is_refused_naming_the_argument(make, culprit) -> None:
    with pytest.raises(ExampleCallError) as err:
        make()
    assert culprit in str(err.value) and isinstance(err.value, hp_core.HpError)


@pytest.mark.parametrize(
    ("data", "culprit"),
    [
        ("int64[2]", "expected a mapping with 'args'"),
        ({"args": [], "other": 1}, "expected a mapping with 'args'"),
        ({"args": "int64[2]"}, "'args' must be a list"),
        ({"kwargs": {"x": [1]}}, "example.kwargs.x: expected a tensor"),
        ({"args": ["int64[x]"]}, "example.args[0]: 'int64[x]' is not a tensor"),
        ({"kwargs": {"no way": 1}}, "must be Python identifiers"),
    ],
)
def test_a_malformed_saved_call_is_refused_naming_its_path(data, culprit) -> None:
    doc = plan_to_dict(hp_core.plan(_meta(models.targets_lm), "tp=2", example_inputs=IDS))
    doc["example"] = data
    with pytest.raises(PlanYAMLError) as err:
        plan_from_dict(doc)
    assert culprit in str(err.value)


def test_a_plan_holds_only_a_recorded_call() -> None:
    p = hp_core.plan(_meta(models.targets_lm), "tp=2")
    with pytest.raises(PlanError, match=r"ShardingPlan\.example: expected an ExampleCall"):
        type(p)(modules=p.modules, mesh_axis_names=("tp",), example={"idx": IDS})


# -- the forward's signature -----------------------------------------------------------------


class _Sig(torch.nn.Module):
    def forward(self, a, b=None, /, *, c=None):
        return a


class _VarKw(torch.nn.Module):
    def forward(self, ids, **kwargs):
        return ids


@pytest.mark.parametrize(
    ("model", "call", "culprit"),
    [
        (
            models.PositionsLM(),
            default_call(models.PositionsLM()),
            "needs its argument 'input_pos'",
        ),
        (models.TargetsLM(), example_call({"tgt": IDS}), "no keyword argument 'tgt'"),
        (models.TargetsLM(), example_call((IDS, IDS, IDS)), "takes 2 positional argument(s)"),
        (models.TargetsLM(), example_call(((IDS,), {"idx": IDS})), "argument 'idx' twice"),
        (_Sig(), example_call(((IDS,), {"b": IDS})), "no keyword argument 'b'"),
    ],
)
def test_a_call_the_forward_cannot_take_is_refused_naming_the_argument(model, call, culprit):
    with pytest.raises(ExampleCallError) as err:
        check_call(model, call)
    msg = str(err.value)
    assert culprit in msg and "example_inputs=" in msg and "--example" in msg


def test_keyword_catch_alls_and_optional_arguments_take_any_call() -> None:
    check_call(_VarKw(), example_call(((IDS,), {"anything": 1})))
    check_call(_Sig(), example_call(((IDS, IDS), {"c": IDS})))


def test_a_forward_that_needs_more_than_the_default_call_is_refused_by_plan() -> None:
    model = _meta(models.positions_lm)
    with pytest.raises(ExampleCallError) as err:
        hp_core.plan(model, "tp=2")
    msg = str(err.value)
    assert "PositionsLM.forward needs its argument 'input_pos'" in msg
    assert "hp's default call forward(int64[1, 4])" in msg
    with pytest.raises(ExampleCallError, match="input_pos"):
        hp_core.explain_roles(model, "tp=2")


def test_a_given_call_the_forward_fails_on_is_an_error_not_a_fallback() -> None:
    model = _meta(models.targets_lm)
    with pytest.raises(ExampleCallError) as err:
        hp_core.plan(model, "tp=2", example_inputs=(IDS.float(),))
    msg = str(err.value)
    assert "TargetsLM.forward(float32[2, 8]) failed on the meta device" in msg
    assert "Fix:" in msg


# -- what the plan does with it -------------------------------------------------------------


def test_the_default_call_is_named_when_it_leaves_optional_arguments_out() -> None:
    model = _meta(models.targets_lm)
    (note,) = hp_core.plan(model, "tp=2").notes
    assert note.startswith("traced TargetsLM.forward(int64[1, 4]) (hp's default call)")
    assert "also takes targets" in note and "example_inputs" in note
    assert hp_core.plan(model, "tp=2", example_inputs={"idx": IDS, "targets": IDS}).notes == []
    # transformers models: their training call runs the layers the default call runs
    hf = build_family("llama", device="meta")
    assert left_out_note(hf, default_call(hf)) is None
    assert left_out_note(model, example_call(IDS)) is None


def test_the_plan_records_the_call_saves_it_and_shows_it() -> None:
    model = _meta(models.targets_lm)
    call = {"idx": IDS, "targets": IDS}
    p = hp_core.plan(model, "tp=2", example_inputs=call)
    assert p.example == example_call(call)
    assert hp_core.plan(model, "tp=2").example is None
    back = load_plan(dump_plan(p))
    assert back.example == p.example and back == p and p.copy().example == p.example
    assert p.fingerprint() == hp_core.plan(model, "tp=2", example_inputs=IDS).fingerprint()
    line = "planned and verified on the training call forward(idx=int64[2, 8], targets=int64[2, 8])"
    assert line in p.explain().splitlines()


def test_the_verifier_runs_the_plans_call_a_ranks_share_of_the_sequence() -> None:
    model = _meta(models.targets_lm)
    p = hp_core.plan(model, "tp=2", example_inputs=((IDS,), {"targets": IDS}))
    with verification_mesh(p, "tp=2") as mesh:
        args, kwargs = example_inputs(p, mesh)
    assert args[0].shape == (2, 8) and kwargs["targets"].shape == (2, 8)
    hf = build_family("llama", device="meta")
    cp = hp_core.plan(hf, "cp=2", example_inputs={"input_ids": IDS, "labels": IDS})
    with verification_mesh(cp, "cp=2") as mesh:
        _, kwargs = example_inputs(cp, mesh)
    assert kwargs["input_ids"].shape == (2, 4)  # this rank's half of the sequence
    with verification_mesh(cp, "cp=2") as mesh:
        assert example_inputs(hp_core.plan(hf, "cp=2"), mesh) is None


def test_the_default_call_plans_another_path_than_the_training_call() -> None:
    """The differential on the meta device: sequence parallelism planned on the default call's
    last-position logits is refused at apply; on the training call it verifies."""
    model = _meta(models.targets_lm)
    with pytest.raises(hp_core.VerificationError, match="lm_head"):
        hp_core.verify(model, hp_core.plan(model, "tp=2"))
    given = hp_core.plan(model, "tp=2", example_inputs={"idx": IDS, "targets": IDS})
    assert hp_core.verify(model, given).summary()


def test_hp_plan_takes_the_call_on_the_command_line(capsys) -> None:
    base = ["plan", "--model", POSITIONS, "--mesh", "tp=2", "--yaml"]
    code = cli.main([*base, "--example", "int64[2,8]", "--example", "input_pos=int64[8]"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert load_plan(out).example == parse_example_texts(["int64[2, 8]", "input_pos=int64[8]"])
    code = cli.main(base)
    out, err = capsys.readouterr()
    assert code == 1 and "needs its argument 'input_pos'" in err
    code = cli.main([*base, "--example", "input_pos=int64[x]"])
    out, err = capsys.readouterr()
    assert code == 2 and "is not a tensor as hp writes one" in err


# -- one device ------------------------------------------------------------------------------


@pytest.mark.parametrize("sp", [True, False])
def test_planned_on_the_training_call_both_models_match_one_device(sp: bool) -> None:
    world = get_world(2)
    for factory, batch, loss in (
        (TARGETS, models.targets_batch, models.targets_loss),
        (POSITIONS, models.positions_batch, models.positions_loss),
    ):
        kwargs = {"sequence_parallel": sp, "example_inputs": batch(0)}
        report = check_equivalence(
            factory, batch, "tp=2", plan_kwargs=kwargs, loss_fn=loss, world=world
        )
        assert report.worst["production:grad"] <= 1e-5
        assert report.worst["production-validate:param"] <= 1e-5


def test_negative_control_the_default_call_is_refused_before_training() -> None:
    with pytest.raises(hp_core.VerificationError, match="lm_head"):
        check_equivalence(
            TARGETS,
            models.targets_batch,
            "tp=2",
            loss_fn=models.targets_loss,
            world=get_world(2),
        )
