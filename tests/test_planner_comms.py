"""Predicted collectives: the transition table, per boundary, per decoder layer, per step."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from hp_core import plan
from hp_core.collectives import Collective, Transition, grad_is_partial, transition
from hp_core.plans.prediction import (
    boundary_collectives,
    boundary_transitions,
    sp_grad_params,
    step_collectives,
)
from hp_core.presets import build_model
from hp_core.spec import ModuleShardingSpec
from tests._planner_helpers import (
    S0,
    S1,
    S2,
    P,
    R,
    builtin_only,  # noqa: F401  (fixture)
)

pytestmark = pytest.mark.usefixtures("builtin_only")


def meta(family: str = "llama", **kw) -> torch.nn.Module:
    return build_model(family, device="meta", **kw)


@pytest.mark.parametrize(
    ("src", "dst", "grad_partial", "expected"),
    [
        (S1, R, True, ("all_gather", "reduce_scatter")),
        (S1, R, False, ("all_gather", None)),
        (R, S1, False, (None, "all_gather")),
        (P, R, False, ("all_reduce", None)),
        (P, S1, False, ("reduce_scatter", "all_gather")),
        (R, R, True, (None, "all_reduce")),
        (R, R, False, (None, None)),
        (S1, S1, True, (None, None)),
        (S1, S2, False, ("all_to_all", "all_to_all")),
        (R, P, False, (None, None)),
    ],
)
def test_transition_table(src, dst, grad_partial, expected):
    assert transition(src, dst, grad_partial=grad_partial) == expected


def test_sp_attention_boundary_collectives_and_transitions():
    p = plan(meta(), "tp=2,cp=2")
    spec = p["model.layers.0.self_attn"]
    assert grad_is_partial(spec, "tp") is True
    assert grad_is_partial(spec, "cp") is False
    fqn = "model.layers.0.self_attn"
    assert boundary_collectives(fqn, spec) == [
        Collective("all_gather", "tp", "forward", f"{fqn} in.hidden_states"),
        Collective("reduce_scatter", "tp", "backward", f"{fqn} in.hidden_states"),
        Collective("reduce_scatter", "tp", "forward", f"{fqn} out.attn_output"),
        Collective("all_gather", "tp", "backward", f"{fqn} out.attn_output"),
    ]
    assert boundary_transitions(fqn, spec) == [
        Transition(fqn, "in", "hidden_states", "cp", S1, S1, None, None),
        Transition(fqn, "in", "hidden_states", "tp", S1, R, "all_gather", "reduce_scatter"),
        Transition(fqn, "out", "attn_output", "cp", S1, S1, None, None),
        Transition(fqn, "out", "attn_output", "tp", P, S1, "reduce_scatter", "all_gather"),
    ]


def test_non_boundaries_and_unpaired_names_cost_nothing():
    spec = ModuleShardingSpec(
        params={}, in_src={"x": {"tp": S1}}, in_dst={"y": {"tp": R}}, is_boundary=True
    )
    assert boundary_transitions("m", spec) == []
    hidden = ModuleShardingSpec(
        params={"w": {"tp": S0}},
        in_src={"x": {"tp": S1}},
        in_dst={"x": {"tp": R}},
        is_boundary=False,
    )
    assert boundary_collectives("m", hidden) == []


def test_per_decoder_layer_sequence_parallel():
    two = step_collectives(plan(meta(num_hidden_layers=2), "tp=2").modules)
    three = step_collectives(plan(meta(num_hidden_layers=3), "tp=2").modules)
    assert three - two == Counter(
        {
            ("forward", "all_gather", "tp"): 2,
            ("forward", "reduce_scatter", "tp"): 2,
            ("backward", "all_gather", "tp"): 2,
            ("backward", "reduce_scatter", "tp"): 2,
        }
    )
    assert two == Counter(
        {
            # 2 layers x 2 + lm_head gathers its input + the vocab-sharded logits
            ("forward", "all_gather", "tp"): 6,
            ("forward", "reduce_scatter", "tp"): 4,
            ("forward", "all_reduce", "tp"): 1,  # vocab-parallel embedding
            # 2 layers x 2 + layer 0's replicate→shard(1) entry
            ("backward", "all_gather", "tp"): 5,
            # 2 layers x 2 + lm_head's input gradient
            ("backward", "reduce_scatter", "tp"): 5,
            ("backward", "all_reduce", "tp"): 1,  # one bucket for the SP-replicated grads
        }
    )


def test_per_decoder_layer_without_sequence_parallel():
    two = step_collectives(plan(meta(num_hidden_layers=2), "tp=2", sequence_parallel=False).modules)
    three = step_collectives(
        plan(meta(num_hidden_layers=3), "tp=2", sequence_parallel=False).modules
    )
    assert three - two == Counter(
        {("forward", "all_reduce", "tp"): 2, ("backward", "all_reduce", "tp"): 2}
    )
    assert two == Counter(
        {
            ("forward", "all_reduce", "tp"): 5,  # embedding + 2 per layer
            ("forward", "all_gather", "tp"): 1,  # logits
            ("backward", "all_reduce", "tp"): 5,  # 2 per layer + lm_head's input gradient
        }
    )


def test_loss_parallel_saves_the_logits_gather_and_cp_adds_one_gradient_reduction():
    base = step_collectives(plan(meta(), "tp=2").modules)
    lp = step_collectives(plan(meta(), "tp=2", loss_parallel=True).modules)
    assert base - lp == Counter({("forward", "all_gather", "tp"): 1})
    # cp shards the sequence everywhere: every parameter's gradient is summed over cp once per step
    assert step_collectives(plan(meta(), "tp=2,cp=2").modules) - base == Counter(
        {("backward", "all_reduce", "cp"): 1}
    )
    # the vocab-parallel cross-entropy adds its own two forward all-reduces
    assert step_collectives(
        plan(meta(), "tp=2", loss_parallel=True).modules, loss_parallel=True
    ) - lp == Counter({("forward", "all_reduce", "tp"): 2})
    assert step_collectives(plan(meta(), "cp=2").modules) == Counter(
        {("backward", "all_reduce", "cp"): 1}
    )


def test_sp_grad_params_are_the_tp_replicated_params_on_sequence_shards():
    p = plan(meta(), "tp=2")
    norms = [
        f"model.layers.{i}.{n}.weight"
        for i in range(2)
        for n in ("input_layernorm", "post_attention_layernorm")
    ]
    assert sp_grad_params(p.modules) == [*norms, "model.norm.weight"]
    assert sp_grad_params(plan(meta(), "tp=2", sequence_parallel=False).modules) == []


def test_deferred_biases_join_the_sp_gradient_bucket():
    p = plan(meta(attention_bias=True, mlp_bias=True), "tp=2")
    grads = sp_grad_params(p.modules)
    assert "model.layers.0.self_attn.o_proj.bias" in grads
    assert "model.layers.1.mlp.down_proj.bias" in grads
    assert not any(
        g.endswith(("q_proj.bias", "gate_proj.bias")) for g in grads
    )  # sharded with their weight
    assert step_collectives(p.modules)[("backward", "all_reduce", "tp")] == 1
    # without SP the bias is added to a replicated output: every rank has the whole gradient
    no_sp = plan(meta(attention_bias=True, mlp_bias=True), "tp=2", sequence_parallel=False)
    assert sp_grad_params(no_sp.modules) == []


def test_ep_experts_are_not_in_the_sp_bucket():
    grads = sp_grad_params(plan(meta("qwen2moe"), "tp=2", ep_size=2).modules)
    assert "model.layers.0.mlp.gate.weight" in grads
    assert "model.layers.0.mlp.shared_expert.down_proj.weight" in grads
    assert not any("experts." in g for g in grads)
