"""Unclaimed parameters on a module between blocks, under sequence parallelism.

With sequence parallelism the blocks hand each other sequence shards. A module of bare
parameters sitting between two blocks (a gain and shift on the residual stream) is refused;
the fix hp prints first makes that module a boundary of its own on those shards, parameters
whole. That fix is only printed once hp has planned and verified it: in validate mode the
module's forward runs on DTensors, so a forward that mixes along the sequence (a running mean)
needs a redistribution the verifier refuses, and hp falls back to keeping the parameters whole
with sequence parallelism off. The negative control plans the token-wise fix on the
sequence-mixing module by hand and shows the verifier refusing it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import hp_core
from hp_core import HpError
from hp_core.planner.structure import UncoveredParameterError, positional_names
from hp_core.planner.trace import _meta_kernels
from hp_core.planner.unclaimed import _local_region, _outermost_free
from hp_core.plans.proposal import Proposal
from hp_core.spec.module_spec import ModuleShardingSpec
from hp_core.testing import check_equivalence, get_world
from hp_core.testing.families import build_family
from hp_core.testing.printed_fix import printed_fix
from tests import _fix_models

PARAMS = {"gain": {"tp": "replicate"}, "shift": {"tp": "replicate"}}
ON_THE_SHARDS = {
    "match": "transformer.mix",
    "params": PARAMS,
    "in_src": {"x": {"tp": "shard(1)"}},
    "in_dst": {"x": {"tp": "shard(1)"}},
    "out_src": {"output": {"tp": "shard(1)"}},
    "out_dst": {"output": {"tp": "shard(1)"}},
}
KEPT_WHOLE = {"match": "transformer.mix", "is_boundary": False, "params": PARAMS}


def _fix(build, sequence_parallel: bool):
    with pytest.raises(UncoveredParameterError) as info:
        hp_core.plan(
            build(),
            "tp=2",
            example_inputs=_fix_models.batch(0),
            sequence_parallel=sequence_parallel,
        )
    message = str(info.value)
    assert "transformer.mix.gain (replicated, shape (64,))" in message
    fix = printed_fix(message)
    assert fix is not None, message
    return fix


def test_a_token_wise_module_gets_a_boundary_on_the_sequence_shards():
    fix = _fix(_fix_models.token_affine_gpt, sequence_parallel=True)
    assert fix.overrides == [ON_THE_SHARDS] and fix.flags == {}


def test_without_sequence_parallel_the_parameters_are_kept_whole():
    fix = _fix(_fix_models.token_affine_gpt, sequence_parallel=False)
    assert fix.overrides == [KEPT_WHOLE] and fix.flags == {}


def test_following_the_boundary_fix_matches_one_device_with_sequence_parallel_on():
    fix = _fix(_fix_models.token_affine_gpt, sequence_parallel=True)
    report = check_equivalence(
        _fix_models.token_affine_gpt,
        _fix_models.batch,
        "tp=2",
        overrides=fix.overrides,
        plan_kwargs={
            **fix.flags,
            "sequence_parallel": True,
            "example_inputs": _fix_models.batch(0),
        },
        loss_fn=_fix_models.loss,
        world=get_world(2),
        steps=3,
    )
    assert report.worst["production:grad"] <= 1e-5 and report.worst["validate:grad"] <= 1e-5
    assert report.worst["production:loss"] <= 1e-5
    # gain and shift included: their gradients are partial over the sequence shards and
    # must have been summed for these to match
    assert report.compared["production:grad"] == report.n_params


def test_a_module_that_mixes_along_the_sequence_is_not_given_the_boundary():
    fix = _fix(_fix_models.running_mean_gpt, sequence_parallel=True)
    assert fix.overrides == [KEPT_WHOLE] and fix.flags == {"sequence_parallel": False}


def test_negative_control_the_boundary_on_a_sequence_mixing_module_does_not_verify():
    """What hp would print if it did not check: it plans, and the verifier refuses it."""
    model = _fix_models.running_mean_gpt()
    p = hp_core.plan(
        model,
        "tp=2",
        overrides=[ON_THE_SHARDS],
        sequence_parallel=True,
        example_inputs=_fix_models.batch(0),
    )
    with pytest.raises(HpError, match=r"transformer\.mix"):
        hp_core.verify(model, p)


def test_fixes_that_need_sequence_parallel_on_and_off_do_not_fit_together():
    on = Proposal("on", "with sp", flags={"sequence_parallel": True})
    off = Proposal("off", "without sp", flags={"sequence_parallel": False})
    plain = Proposal("plain", "no flag")
    assert not on.fits(off) and not off.fits(on)
    assert on.fits(plain) and plain.fits(off) and on.fits(on)


def test_the_outermost_free_module_stops_below_a_planned_one():
    planned = {"h.0.attn": object(), "h.1.mlp": object()}
    assert _outermost_free("h.0.mix.inner", planned) == "h.0.mix"
    assert _outermost_free("h.0.attn", planned) is None  # itself planned
    assert _outermost_free("h.0", planned) is None  # holds a planned module
    assert _outermost_free("mix", planned) == "mix"


def test_positional_names_lists_the_forward_parameters_in_order():
    class Two(nn.Module):
        def forward(self, x, y=None, *rest, scale=1.0):
            return x

    assert positional_names(Two()) == ["x", "y"]
    assert positional_names(nn.Linear(2, 2)) == ["input"]


def test_the_trace_kernels_are_restored_after_it():
    """The trace switches MoE experts to batched_mm and lets nonzero run on meta; the user's
    configs and torch's flag must be as they were afterwards, also when the trace fails."""
    import torch.fx.experimental._config as fx_config

    model = nn.Sequential(nn.Linear(2, 2))
    shared = SimpleNamespace(_experts_implementation="grouped_mm")
    model[0].config = shared
    model.config = shared  # one config on two modules: switched and restored once
    before = fx_config.meta_nonzero_assume_all_nonzero
    with pytest.raises(RuntimeError, match="inside"):
        with _meta_kernels(model):
            assert shared._experts_implementation == "batched_mm"
            assert fx_config.meta_nonzero_assume_all_nonzero is True
            assert torch.nonzero(torch.ones(3, device="meta")).shape == (3, 1)
            raise RuntimeError("inside")
    assert shared._experts_implementation == "grouped_mm"
    assert fx_config.meta_nonzero_assume_all_nonzero == before


def test_a_layers_own_scale_joins_the_layer_region_with_sequence_parallel_on():
    """Dory's per-layer residual scales (lambda_1/_2) sit on the decoder layer, which under
    sequence parallelism is a local region that shards the stream at entry: the first fix
    adds them to it whole (sequence parallelism stays on), and once the fixes that follow are
    applied too the verifier derives their gradients as partial on tp (the sum over the
    sequence shards; the matrix's dory and doge rows match one device with it)."""
    model = build_family("dory", device="meta")
    overrides: list = []
    for _ in range(4):
        try:
            p = hp_core.plan(model, "tp=2", sequence_parallel=True, overrides=overrides or None)
            report = hp_core.verify(model, p)
            break
        except HpError as e:
            fix = printed_fix(str(e))
            assert fix is not None and fix.flags.get("sequence_parallel") is not False, str(e)
            if not overrides:
                assert fix.overrides[0] == {
                    "match": "model.layers.0",
                    "params": {"lambda_1": {"tp": "replicate"}, "lambda_2": {"tp": "replicate"}},
                }
            overrides += [o for o in fix.overrides if o not in overrides]
    else:
        pytest.fail(f"dory did not verify after following 4 fixes: {overrides}")
    assert p["model.layers.1"].is_boundary and p["model.layers.1"].region_dispatch is False
    partial = report.partial()
    assert partial["model.layers.0.lambda_1"] == partial["model.layers.1.lambda_2"] == ("tp",)


def test_only_a_local_region_of_whole_parameters_takes_a_layers_own_scale():
    """Negative controls: a region on DTensors, or one with a split parameter (whose code may
    meet split values), cannot take a kept-whole parameter by the contract's rule."""
    seq = {"hidden_states": {"tp": Shard(1)}}

    def region(**kw):
        return ModuleShardingSpec(in_src=seq, in_dst=seq, **kw)

    assert _local_region(region(params={}, region_dispatch=False))
    assert _local_region(region(params={"w": {"tp": Replicate()}}, region_dispatch=False))
    assert not _local_region(region(params={"w": {"tp": Shard(0)}}, region_dispatch=False))
    assert not _local_region(region(params={}))  # runs on DTensors in validate mode
    assert not _local_region(ModuleShardingSpec(is_boundary=False, params={}))
    assert not _local_region(None)
