"""Parameter roles and the rules that assign them."""

from __future__ import annotations

import pytest

from hp_core.planner.templates import DEFAULT_ROLE_RULES, Role, RoleRule, classify_param


@pytest.mark.parametrize(
    "fqn,role",
    [
        ("model.embed_tokens.weight", Role.EMBED),
        ("lm_head.weight", Role.LM_HEAD),
        ("model.norm.weight", Role.NORM),
        ("model.layers.0.input_layernorm.weight", Role.NORM),
        ("model.layers.0.self_attn.q_proj.weight", Role.COLWISE),
        ("model.layers.0.self_attn.k_proj.bias", Role.COLWISE),
        ("model.layers.0.mlp.up_proj.weight", Role.COLWISE),
        ("model.layers.0.self_attn.o_proj.weight", Role.ROWWISE),
        ("model.layers.0.mlp.down_proj.bias", Role.ROWWISE),
        ("model.layers.0.self_attn.qkv_proj.weight", Role.FUSED_QKV),
        ("model.layers.0.mlp.gate_up_proj.weight", Role.FUSED_GATE_UP),
        ("model.layers.0.mlp.experts.gate_up_proj", Role.MOE_EXPERT),
        ("model.layers.0.block_sparse_moe.experts.3.w1.weight", Role.MOE_EXPERT),
        ("model.layers.0.mlp.gate.weight", Role.MOE_ROUTER),
        ("model.layers.0.block_sparse_moe.gate.weight", Role.MOE_ROUTER),
        ("model.layers.0.mlp.shared_expert_gate.weight", Role.SHARED_EXPERT_GATE),
        ("model.layers.0.mlp.shared_expert.gate_proj.weight", Role.COLWISE),
        ("model.rotary_emb.something", Role.REPLICATED),
    ],
)
def test_default_rules_classify_hf_names(fqn, role):
    assert classify_param(fqn, DEFAULT_ROLE_RULES) is role


def test_architecture_scoped_rules_take_precedence_only_for_their_architecture():
    rule = RoleRule(
        "phi.dense", r"\.dense\.weight$", Role.COLWISE, architectures=("PhiForCausalLM",)
    )
    rules = [*DEFAULT_ROLE_RULES, rule]
    assert (
        classify_param("model.layers.0.self_attn.dense.weight", rules, ["PhiForCausalLM"])
        is Role.COLWISE
    )
    assert (
        classify_param("model.layers.0.self_attn.dense.weight", rules, ["LlamaForCausalLM"])
        is Role.ROWWISE
    )
    assert rule.matches("a.dense.weight", ["PhiForCausalLM"]) and not rule.matches("a.dense.weight")


def test_role_rule_validation():
    with pytest.raises(ValueError, match=r"RoleRule 'x': role must be a hp_core.Role"):
        RoleRule("x", "a", "colwise")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"RoleRule 'x': architectures must be a tuple of class names"
    ):
        RoleRule("x", "a", Role.NORM, architectures="LlamaForCausalLM")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"RoleRule 'x': pattern '\(' is not a regular expression"):
        RoleRule("x", "(", Role.NORM)
    assert RoleRule("x", "a", Role.NORM, architectures=["A"]).architectures == ("A",)  # type: ignore[arg-type]
    assert str(Role.MOE_EXPERT) == "moe_expert"


def test_default_rule_names_are_unique():
    names = [r.name for r in DEFAULT_ROLE_RULES]
    assert len(names) == len(set(names)) and all(n.startswith("role.") for n in names)
