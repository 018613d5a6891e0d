"""plan() on META-device real HF models: every boundary kind with its exact contract.

Sequence parallel on/off, loss parallel, tp=2, a 2-D ``dp=2,tp=2`` mesh, cp, biases,
tied embeddings, determinism, and the model left untouched.
"""

from __future__ import annotations

import time

import pytest
import torch

from hp_core import plan
from hp_core.context import ParallelContext
from hp_core.mesh import MeshSpec
from hp_core.plans import ShardingPlan
from hp_core.presets import build_model, model_from_config, preset_config
from tests._planner_helpers import (
    S1,
    L,
    builtin_only,  # noqa: F401  (fixture)
    contract,
)

pytestmark = pytest.mark.usefixtures("builtin_only")

LAYER_KINDS = ["", ".self_attn", ".mlp", ".input_layernorm", ".post_attention_layernorm"]


def meta(family: str, **overrides) -> torch.nn.Module:
    return build_model(family, device="meta", **overrides)


def llama_order(sp: bool) -> list[str]:
    order = ["model.embed_tokens"]
    for i in range(2):
        order += [f"model.layers.{i}{k}" for k in LAYER_KINDS if sp or k]
    return [*order, "model.norm", "lm_head"]


# ------------------------------------------------------------------ expected contracts

EMBED = {
    "params": {"weight": L(tp="shard(0)")},
    "in_src": {},
    "in_dst": {},
    "out_src": {"output": L(tp="partial")},
    "out_dst": {"output": L(tp="replicate")},
}


def norm(tp: str) -> dict:
    return {
        "params": {"weight": L(tp="replicate")},
        "in_src": {"hidden_states": L(tp=tp)},
        "in_dst": {"hidden_states": L(tp=tp)},
        "out_src": {"output": L(tp=tp)},
        "out_dst": {"output": L(tp=tp)},
    }


def attention(between: str, **extra) -> dict:
    return {
        "params": {
            "q_proj.weight": L(tp="shard(0)"),
            "k_proj.weight": L(tp="shard(0)"),
            "v_proj.weight": L(tp="shard(0)"),
            "o_proj.weight": L(tp="shard(1)"),
        },
        "in_src": {"hidden_states": L(tp=between)},
        "in_dst": {"hidden_states": L(tp="replicate")},
        "out_src": {"attn_output": L(tp="partial")},
        "out_dst": {"attn_output": L(tp=between)},
        "out_names": ["attn_output", "attn_weights"],
        "_needs_cp_attn": True,
        **extra,
    }


def mlp(between: str) -> dict:
    return {
        "params": {
            "gate_proj.weight": L(tp="shard(0)"),
            "up_proj.weight": L(tp="shard(0)"),
            "down_proj.weight": L(tp="shard(1)"),
        },
        "in_src": {"x": L(tp=between)},
        "in_dst": {"x": L(tp="replicate")},
        "out_src": {"output": L(tp="partial")},
        "out_dst": {"output": L(tp=between)},
    }


def layer(first: bool) -> dict:
    return {
        "params": {},
        "in_src": {"hidden_states": L(tp="replicate" if first else "shard(1)")},
        "in_dst": {"hidden_states": L(tp="shard(1)")},
        "out_src": {"output": L(tp="shard(1)")},
        "out_dst": {"output": L(tp="shard(1)")},
        "region_dispatch": False,
    }


def lm_head(between: str, logits: str = "replicate") -> dict:
    return {
        "params": {"weight": L(tp="shard(0)")},
        "in_src": {"input": L(tp=between)},
        "in_dst": {"input": L(tp="replicate")},
        "out_src": {"output": L(tp="shard(2)")},
        "out_dst": {"output": L(tp=logits)},
        "_is_terminal": True,
    }


# ------------------------------------------------------------------------------ tests


def test_llama_sequence_parallel_tp2_every_boundary():
    p = plan(meta("llama"), "tp=2")
    assert isinstance(p, ShardingPlan)
    assert list(p) == llama_order(sp=True)
    assert (p.mesh_axis_names, p.mesh_shape) == (("tp",), (2,))
    assert (p.sequence_parallel, p.loss_parallel, p.ep_size, p.notes) == (True, False, 1, [])
    assert contract(p["model.embed_tokens"]) == EMBED
    assert contract(p["model.layers.0"]) == layer(first=True)
    assert contract(p["model.layers.1"]) == layer(first=False)
    for i in range(2):
        assert contract(p[f"model.layers.{i}.self_attn"]) == attention("shard(1)")
        assert contract(p[f"model.layers.{i}.mlp"]) == mlp("shard(1)")
        assert contract(p[f"model.layers.{i}.input_layernorm"]) == norm("shard(1)")
        assert contract(p[f"model.layers.{i}.post_attention_layernorm"]) == norm("shard(1)")
    assert contract(p["model.norm"]) == norm("shard(1)")
    assert contract(p["lm_head"]) == lm_head("shard(1)")
    assert p.boundaries() == p.modules  # every derived spec wraps forward


def test_llama_without_sequence_parallel_replicates_between_blocks_and_has_no_layer_boundaries():
    p = plan(meta("llama"), "tp=2", sequence_parallel=False)
    assert list(p) == llama_order(sp=False)
    assert p.sequence_parallel is False
    assert contract(p["model.embed_tokens"]) == EMBED
    for i in range(2):
        assert contract(p[f"model.layers.{i}.self_attn"]) == attention("replicate")
        assert contract(p[f"model.layers.{i}.mlp"]) == mlp("replicate")
        assert contract(p[f"model.layers.{i}.input_layernorm"]) == norm("replicate")
    assert contract(p["model.norm"]) == norm("replicate")
    assert contract(p["lm_head"]) == lm_head("replicate")


@pytest.mark.parametrize("sp", [True, False])
def test_loss_parallel_keeps_the_logits_vocab_sharded(sp):
    p = plan(meta("llama"), "tp=2", sequence_parallel=sp, loss_parallel=True)
    assert p.loss_parallel is True
    assert contract(p["lm_head"]) == lm_head("shard(1)" if sp else "replicate", logits="shard(2)")


def test_two_d_mesh_with_dp_plans_one_dp_slice():
    p2d = plan(meta("llama"), "dp=2,tp=2")
    p1d = plan(meta("llama"), "tp=2")
    assert (p2d.mesh_axis_names, p2d.mesh_shape) == (("dp", "tp"), (2, 2))
    assert p2d.modules == p1d.modules  # dp never appears in a contract
    assert all("dp" not in str(contract(s)) for s in p2d.modules.values())


def test_context_parallel_shards_every_activation_on_cp_and_no_parameter():
    p = plan(meta("llama"), "tp=2,cp=2")
    assert list(p) == llama_order(sp=True)
    attn = contract(p["model.layers.0.self_attn"])
    assert attn["in_src"] == {"hidden_states": L(cp="shard(1)", tp="shard(1)")}
    assert attn["in_dst"] == {"hidden_states": L(cp="shard(1)", tp="replicate")}
    assert attn["out_src"] == {"attn_output": L(cp="shard(1)", tp="partial")}
    assert attn["out_dst"] == {"attn_output": L(cp="shard(1)", tp="shard(1)")}
    assert attn["params"]["q_proj.weight"] == L(cp="replicate", tp="shard(0)")
    assert attn["_needs_cp_attn"] is True
    assert contract(p["model.embed_tokens"]) == {
        "params": {"weight": L(cp="replicate", tp="shard(0)")},
        "in_src": {"input": L(cp="shard(1)")},
        "in_dst": {"input": L(cp="shard(1)")},
        "out_src": {"output": L(cp="shard(1)", tp="partial")},
        "out_dst": {"output": L(cp="shard(1)", tp="replicate")},
    }
    assert contract(p["model.layers.0"])["in_src"] == {
        "hidden_states": L(cp="shard(1)", tp="replicate")
    }
    assert contract(p["lm_head"])["out_src"] == {"output": L(cp="shard(1)", tp="shard(2)")}
    for fqn, spec in p.items():
        for rel, named in spec.params.items():
            assert named["cp"] == L(cp="replicate")["cp"], (fqn, rel)  # CP never shards parameters
        for field in ("in_src", "in_dst", "out_src", "out_dst"):
            for name, layout in getattr(spec, field).items():
                assert layout["cp"] == S1, (fqn, field, name)


def test_cp_only_mesh_has_no_tp_layouts_and_no_layer_boundaries():
    p = plan(meta("llama"), "cp=2")
    assert list(p) == llama_order(sp=False)
    assert contract(p["model.layers.0.self_attn"]) == {
        **attention("replicate"),
        "params": {
            k: L(cp="replicate")
            for k in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")
        },
        "in_src": {"hidden_states": L(cp="shard(1)")},
        "in_dst": {"hidden_states": L(cp="shard(1)")},
        "out_src": {"attn_output": L(cp="shard(1)")},
        "out_dst": {"attn_output": L(cp="shard(1)")},
    }
    assert contract(p["lm_head"])["out_dst"] == {"output": L(cp="shard(1)")}


def test_rowwise_biases_are_deferred_and_colwise_biases_shard_with_their_weight():
    p = plan(meta("llama", attention_bias=True, mlp_bias=True), "tp=2")
    attn = contract(p["model.layers.0.self_attn"])
    assert attn["params"] == {
        "q_proj.weight": L(tp="shard(0)"),
        "q_proj.bias": L(tp="shard(0)"),
        "k_proj.weight": L(tp="shard(0)"),
        "k_proj.bias": L(tp="shard(0)"),
        "v_proj.weight": L(tp="shard(0)"),
        "v_proj.bias": L(tp="shard(0)"),
        "o_proj.weight": L(tp="shard(1)"),
        "o_proj.bias": L(tp="replicate"),
    }
    assert attn["_deferred_bias_params"] == ("o_proj.bias",)
    mlp_spec = contract(p["model.layers.1.mlp"])
    assert mlp_spec["params"]["gate_proj.bias"] == L(tp="shard(0)")
    assert mlp_spec["params"]["down_proj.bias"] == L(tp="replicate")
    assert mlp_spec["_deferred_bias_params"] == ("down_proj.bias",)
    # without tp nothing leaves as partial, so nothing is deferred
    p_cp = plan(meta("llama", attention_bias=True, mlp_bias=True), "cp=2")
    assert all(not s._deferred_bias_params for s in p_cp.modules.values())


def test_qwen2_qkv_biases_shard_and_nothing_is_deferred():
    p = plan(meta("qwen2"), "tp=2")
    attn = contract(p["model.layers.0.self_attn"])
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert attn["params"][f"{proj}.bias"] == L(tp="shard(0)")
    assert "o_proj.bias" not in attn["params"]
    assert "_deferred_bias_params" not in attn
    assert list(p) == llama_order(sp=True)


def test_mistral_plans_like_llama():
    assert plan(meta("mistral"), "tp=2").modules == plan(meta("llama"), "tp=2").modules


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_embeddings(tied):
    model = meta("llama", tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    p = plan(model, "tp=2")
    assert contract(p["lm_head"]) == lm_head("shard(1)")
    assert contract(p["model.embed_tokens"]) == EMBED


def test_planning_is_deterministic_and_device_independent():
    a = plan(meta("llama", attention_bias=True), "tp=2,cp=2")
    b = plan(meta("llama", attention_bias=True), "tp=2,cp=2")
    c = plan(build_model("llama", attention_bias=True), MeshSpec(("tp", "cp"), (2, 2)))
    assert a == b == c
    assert a.fingerprint() == b.fingerprint() == c.fingerprint()
    assert a.fingerprint() != plan(meta("llama", attention_bias=True), "tp=2").fingerprint()


def test_mesh_forms_are_equivalent():
    model = meta("llama")
    ref = plan(model, "tp=2,cp=2")
    assert plan(model, {"tp": 2, "cp": 2}) == ref
    assert plan(model, MeshSpec(("tp", "cp"), (2, 2))) == ref


def test_the_model_is_left_untouched():
    model = build_model("llama", attention_bias=True, mlp_bias=True)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_modules()]
    param_ids = {n: id(p) for n, p in model.named_parameters()}
    plan(
        model,
        "tp=2,cp=2",
        overrides=[{"match": "model.norm", "out_dst": {"tp": "replicate", "cp": "shard(1)"}}],
    )
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [n for n, _ in model.named_modules()] == names
    assert {n: id(p) for n, p in model.named_parameters()} == param_ids
    assert all(p.requires_grad and type(p) is torch.nn.Parameter for p in model.parameters())
    for name, module in model.named_modules():
        assert "forward" not in vars(module), name
        assert not module._forward_hooks and not module._forward_pre_hooks, name
        assert module.training, name


def test_active_axes():
    mesh = MeshSpec.parse("dp=2,tp=2,cp=2")
    assert ParallelContext.from_spec(mesh, sequence_parallel=True, ep_size=1).guard_axes == {
        "tp",
        "cp",
        "sp",
    }
    assert ParallelContext.from_spec(mesh, sequence_parallel=False, ep_size=2).guard_axes == {
        "tp",
        "cp",
        "ep",
    }
    assert ParallelContext.from_spec(
        MeshSpec.parse("tp=1,cp=2"), sequence_parallel=True, ep_size=1
    ).guard_axes == {"cp"}
    assert (
        ParallelContext.from_spec(
            MeshSpec.parse("dp=4"), sequence_parallel=True, ep_size=1
        ).guard_axes
        == set()
    )


def test_a_mesh_without_tp_or_cp_shards_nothing():
    p = plan(meta("llama"), "dp=4")
    assert list(p) == llama_order(sp=False)
    for spec in p.modules.values():
        assert spec.params == {} and spec.in_src == {} and spec.out_dst == {}


def test_7b_llama_at_tp8_plans_in_well_under_a_second():
    model = model_from_config(preset_config("llama-7b"))
    start = time.perf_counter()
    p = plan(model, "tp=8")
    elapsed = time.perf_counter() - start
    print(f"\nplan(llama-7b, tp=8) on meta: {elapsed * 1000:.1f} ms, {len(p)} modules")
    assert elapsed < 2.0
    assert len(p) == 1 + 32 * 5 + 2
    assert p["model.layers.31.self_attn"].params["q_proj.weight"] == L(tp="shard(0)")
    assert p["lm_head"].params["weight"] == L(tp="shard(0)")
