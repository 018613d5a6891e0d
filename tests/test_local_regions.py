"""Local regions (code hp runs on local tensors in either mode) on real model code.

* A local region whose code fails on the planned shards while the unsharded model runs the
  same code on meta is refused by the verifier: only a meta-device limitation earns the
  pass-through (``hp_core.verifier.probes.opaque_fallback``).
* Parameter-only specs (``is_boundary: false``) inside a local region are unwrapped for its
  code in validate mode as the region's own parameters are.
* A module with no forward of its own (minGPT's ModuleDict MLP, run by its parent's code)
  is declared whole instead of wrapped.
* The meta trace reads tensors a model holds outside its parameters and buffers (gpt-fast's
  ``freqs_cis``) on meta.
"""

from __future__ import annotations

import pytest
import torch

import hp_core
from hp_core.planner import trace as trace_mod
from hp_core.planner.trace import meta_operands
from hp_core.runtime import install
from hp_core.testing import EquivalenceFactoryError, check_equivalence, get_world
from hp_core.testing.printed_fix import printed_fix
from hp_core.verifier import runner
from hp_core.verifier.errors import ProductionDiffersError
from hp_core.verifier.meta import meta_clone
from tests import _example_call_models as models
from tests.zoo import gpt_fast, mingpt

IDS = torch.zeros(2, 8, dtype=torch.long)
CALL = {"idx": IDS, "targets": IDS}
MINGPT_ATTN_WHOLE = [
    {
        "match": "transformer.h.*.attn",
        "params": {
            f"{lin}.{p}": {"tp": "replicate"}
            for lin in ("c_attn", "c_proj")
            for p in ("weight", "bias")
        },
        "out_src": {"output": {"tp": "replicate"}},
    }
]


def _meta(factory):
    with torch.device("meta"):
        return factory()


def test_a_region_failing_on_its_shards_where_the_whole_model_runs_is_refused() -> None:
    model = _meta(models.table_lm)
    p = hp_core.plan(model, "tp=2", example_inputs=CALL)
    assert p["h.0"].region_dispatch is False  # a local region under sequence parallelism
    with pytest.raises(ProductionDiffersError) as err:
        hp_core.verify(model, p)
    msg = str(err.value)
    assert msg.startswith("h.0 (TableBlock): in validate mode this region's code fails")
    assert "not a meta-device limitation" in msg and "sequence_parallel=False" in msg
    # Keeping the block whole does not verify (its nested norms still expect sequence shards),
    # so the fix hp prints — after planning and verifying it — turns sequence parallel off.
    fix = printed_fix(msg)
    assert fix is not None and fix.overrides == [] and fix.flags == {"sequence_parallel": False}
    assert hp_core.verify(
        model, hp_core.plan(model, "tp=2", sequence_parallel=False, example_inputs=CALL)
    )


def test_negative_control_without_the_unsharded_run_the_region_is_passed_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the unsharded model's code does not run on meta either, the region passes its
    input through (opaque): the refusal above comes from comparing with that run."""
    model = _meta(models.table_lm)
    p = hp_core.plan(model, "tp=2", example_inputs=CALL)

    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the unsharded model's own code does not run on meta")

    monkeypatch.setattr(runner, "plain_pass", fails)
    assert hp_core.verify(model, p).summary()


def test_a_module_without_a_forward_is_declared_whole_not_wrapped() -> None:
    model = _meta(mingpt.tiny)
    p = hp_core.plan(model, "tp=2", overrides=MINGPT_ATTN_WHOLE, example_inputs=mingpt.batch(0))
    mlp = p["transformer.h.0.mlp"]
    assert mlp.is_boundary is False
    assert str(mlp.params["c_fc.weight"]["tp"]) == "R"
    note = next(n for n in p.notes if n.startswith("transformer.h.0.mlp (ModuleDict)"))
    assert "never runs its forward" in note


def test_parameter_only_specs_inside_a_local_region_are_unwrapped_in_validate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _meta(mingpt.tiny)
    p = hp_core.plan(model, "tp=2", overrides=MINGPT_ATTN_WHOLE, example_inputs=mingpt.batch(0))
    assert p["transformer.h.0"].region_dispatch is False
    nested = install.nested_layouts(p, "transformer.h.0")
    assert {"mlp.c_fc.weight", "mlp.c_proj.bias"} <= set(nested)
    assert "attn.c_attn.weight" not in nested  # a boundary's own, not the layer's
    hp_core.verify(model, p)
    # negative control: the region's code meets the nested DTensors as they are
    monkeypatch.setattr(install, "nested_layouts", lambda plan, fqn: {})
    with pytest.raises(ProductionDiffersError, match=r"mixed torch\.Tensor and DTensor"):
        hp_core.verify(model, p)


@pytest.mark.parametrize("sp", [True, False])
def test_mingpt_with_its_lambda_mlp_matches_one_device(sp: bool) -> None:
    """The check builds each copy with the factory: minGPT's ``mlpf`` lambda closes over its
    own model's MLP, which ``copy.deepcopy`` would leave pointing at the original."""
    report = check_equivalence(
        "tests.zoo.mingpt:tiny",
        mingpt.batch,
        "tp=2",
        overrides=MINGPT_ATTN_WHOLE,
        plan_kwargs={"sequence_parallel": sp, "example_inputs": mingpt.batch(0)},
        loss_fn=mingpt.output_loss,
        world=get_world(2),
    )
    assert report.worst["production:grad"] <= 1e-5 and report.worst["validate:grad"] <= 1e-5


def test_a_factory_building_another_model_on_its_second_call_is_refused() -> None:
    with pytest.raises(EquivalenceFactoryError, match="built another model on its second call"):
        check_equivalence(
            "tests._example_call_models:drifting_lm",
            models.targets_batch,
            "tp=2",
            plan_kwargs={"example_inputs": CALL},
            loss_fn=models.targets_loss,
            world=get_world(2),
        )


def test_tensors_held_outside_parameters_and_buffers_are_read_on_meta(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu, meta = torch.ones(3), torch.empty(3, device="meta")
    args, kwargs = meta_operands((cpu, meta), {"k": cpu, "n": 1})
    assert args[0].is_meta and args[1] is meta and kwargs["k"].is_meta and kwargs["n"] == 1
    assert meta_operands((cpu,), {})[0][0] is cpu  # nothing on meta: nothing to convert
    model = gpt_fast.tiny()
    assert isinstance(model.freqs_cis, torch.Tensor) and not model.freqs_cis.is_meta
    call = hp_core.plans.example.example_call(gpt_fast.batch(0))
    assert trace_mod.trace(model, call).projections  # the trace runs
    monkeypatch.setattr(trace_mod, "meta_operands", lambda a, k: (a, k))
    with pytest.raises(trace_mod.TraceFailedError, match="not on the expected device meta"):
        trace_mod.trace(model, call)


def test_the_verifiers_copy_rebinds_lambdas_that_close_over_the_model() -> None:
    model = mingpt.tiny()
    clone = meta_clone(model)
    fn = clone.transformer.h[0].mlpf
    (cell,) = (c for c in fn.__closure__ if isinstance(c.cell_contents, torch.nn.Module))
    assert cell.cell_contents is clone.transformer.h[0].mlp
    assert model.transformer.h[0].mlpf.__closure__[0].cell_contents is model.transformer.h[0].mlp
    assert fn(torch.empty(1, 2, 48, device="meta")).is_meta  # runs the copy's meta weights
