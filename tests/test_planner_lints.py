"""Every planner error path: the exact exception type, the culprit (module FQN / YAML path)
and the fix in the message; and that the documented fixes work."""

from __future__ import annotations

import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM

import hp_core.planner.plan as planner_pkg
from hp_core import plan
from hp_core.mesh import MeshSpecError
from hp_core.planner.lints import (
    CoverageError,
    DivisibilityError,
    FusedProjectionError,
    MeshAxisError,
    PlanningError,
)
from hp_core.planner.structure import UncoveredParameterError
from hp_core.planner.templates import BoundaryTemplate
from hp_core.plans import IncompleteOverrideError, OverrideError, PlanError
from hp_core.plugins import register_template
from hp_core.presets import build_model
from hp_core.spec import ModuleShardingSpec
from hp_core.testing.printed_fix import printed_fix
from hp_core.verifier.advice import SP_OFF, VERIFIED
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)
from tests._toy_models import (
    WithStrayParameter,
    fused_mlp_lm,
    fused_qkv_lm,
    head_attention_lm,
)

pytestmark = pytest.mark.usefixtures("builtin_only")


def meta(family: str = "llama", **kw) -> torch.nn.Module:
    return build_model(family, device="meta", **kw)


def raises(exc_type, model, mesh="tp=2", **kw) -> str:
    """Plan, expect exactly ``exc_type``, return the message."""
    with pytest.raises(exc_type) as info:
        plan(model, mesh, **kw)
    assert type(info.value) is exc_type, f"{type(info.value).__name__}: {info.value}"
    assert isinstance(info.value, ValueError)
    return str(info.value)


# ------------------------------------------------------------------ divisibility


def test_kv_heads_that_tp_does_not_divide():
    msg = raises(DivisibilityError, meta(), "tp=4")
    assert msg.startswith(
        "model.layers.0.self_attn: 2 key/value heads (k_proj.weight: (32, 64), head_dim 16) "
        "cannot be split over tp=4. Each rank must hold whole heads.\nFix: choose a tp size "
        "that divides 2, or keep model.layers.0.self_attn whole on tp.\n"
    )
    # the keep-whole override, for the attention of every layer, planned and verified by hp
    fix = printed_fix(msg)
    assert fix is not None and fix.overrides[0]["match"] == "model.layers.*.self_attn", msg
    assert fix.overrides[0]["params"]["k_proj.weight"] == {"tp": "replicate"}


def test_query_heads_that_tp_does_not_divide():
    msg = raises(DivisibilityError, meta(num_key_value_heads=4), "tp=8")
    assert msg.startswith(
        "model.layers.0.self_attn: 4 query heads (q_proj.weight: (64, 64), head_dim 16)"
    )
    assert "tp=8" in msg


def test_intermediate_size_that_tp_does_not_divide():
    msg = raises(DivisibilityError, meta(intermediate_size=130, num_key_value_heads=4), "tp=4")
    assert msg == (
        "model.layers.0.mlp.params.gate_proj.weight.tp: dim 0 of shape (130, 64) has size "
        "130, which "
        "tp=4 does not divide. Choose a tp size that divides 130, or replicate this parameter."
    )


def test_shard_dim_out_of_range():
    msg = raises(
        DivisibilityError,
        meta(),
        overrides=[{"match": "lm_head", "params": {"weight": {"tp": "shard(3)"}}}],
    )
    assert (
        msg == "lm_head.params.weight.tp: shard(3) on a 2-D parameter of shape (128, 64); valid "
        "dims are 0..1."
    )


def test_tp_divide_attrs_that_tp_does_not_divide():
    model = head_attention_lm()
    model.model.layers[1].self_attn.groups = 3
    msg = raises(
        DivisibilityError,
        model,
        overrides=[{"match": "model.layers.1.self_attn", "tp_divide_attrs": ["groups"]}],
    )
    assert msg.startswith("model.layers.1.self_attn.groups = 3 is not divisible by tp=2")


# ------------------------------------------------------------------- overrides


def test_axis_typo_names_the_yaml_path_and_the_closest_axis():
    msg = raises(
        OverrideError,
        meta(),
        overrides=[{"match": "lm_head", "out_dst": {"output": {"tpp": "replicate"}}}],
    )
    assert msg.startswith(
        "overrides[0].out_dst.output.tpp: mesh axis 'tpp' is neither a dimension of the mesh"
    )
    assert "Did you mean 'tp'?" in msg


def test_dp_placement_is_refused():
    msg = raises(
        OverrideError,
        meta(),
        "dp=2,tp=2",
        overrides=[{"match": "model.norm", "params": {"weight": {"dp": "shard(0)"}}}],
    )
    assert msg.startswith("overrides[0].params.weight.dp: placement on data-parallel axis 'dp'.")
    assert "FSDP/DDP" in msg


def test_exact_key_that_is_not_a_module_lists_close_matches():
    msg = raises(
        OverrideError,
        meta(),
        overrides={"model.layer.0.mlp": ModuleShardingSpec(region_dispatch=False)},
    )
    assert msg.startswith(
        "overrides['model.layer.0.mlp'].match: 'model.layer.0.mlp' is not a module of the model."
    )
    assert "'model.layers.0.mlp'" in msg


def test_insert_without_a_full_contract():
    msg = raises(
        IncompleteOverrideError, meta(), overrides=[{"match": "model.rotary_emb", "params": "none"}]
    )
    assert msg.startswith("overrides[0]: override for 'model.rotary_emb' inserts a new boundary")
    assert "missing: in_src, in_dst, out_src, out_dst" in msg


def test_a_placement_on_an_axis_the_mesh_lacks_and_its_when_fix():
    override = [
        {"match": "model.norm", "params": {"weight": {"cp": "replicate", "tp": "replicate"}}}
    ]
    msg = raises(MeshAxisError, meta(), overrides=override)
    assert msg == (
        "model.norm.params.weight: axis 'cp' is not a dimension of the mesh tp=2. Add the "
        "axis to the "
        "mesh, or guard the override with 'when: cp' so it applies only when that axis is active."
    )
    plan(meta(), "tp=2", overrides=[{**override[0], "when": "cp"}])  # the fix


def test_region_dispatch_true_without_an_injection():
    msg = raises(
        PlanningError, meta(), overrides=[{"match": "model.norm", "region_dispatch": True}]
    )
    assert msg.startswith("model.norm: region_dispatch=True without an injection is redundant")
    assert "region_dispatch: false" in msg


def test_a_declared_parameter_that_does_not_exist():
    override = [{"match": "lm_head", "params": {"wieght": {"tp": "shard(0)"}}}]
    msg = raises(PlanningError, meta(), overrides=override)
    assert msg.startswith(
        "lm_head.params: 'wieght' is not a parameter of 'lm_head' (Linear). Did you mean 'weight'?"
    )


def test_a_declared_parameter_under_a_missing_submodule():
    msg = raises(
        PlanningError,
        meta(),
        overrides=[{"match": "model.layers.0.mlp", "params": {"gate.weight": {"tp": "shard(0)"}}}],
    )
    assert msg.startswith(
        "model.layers.0.mlp.params: 'gate.weight' is not a parameter of 'model.layers.0.mlp' "
        "(LlamaMLP)."
    )


def test_a_partial_parameter():
    msg = raises(
        PlanningError,
        meta(),
        overrides=[{"match": "model.norm", "params": {"weight": {"tp": "partial"}}}],
    )
    assert (
        msg == "model.norm.params.weight.tp: a parameter cannot be 'partial'; use shard(N) or "
        "replicate."
    )


def test_tp_divide_attrs_typo_and_non_integer():
    model = head_attention_lm()
    msg = raises(
        PlanningError,
        model,
        overrides=[{"match": "model.layers.0.self_attn", "tp_divide_attrs": ["num_head"]}],
    )
    assert msg.startswith(
        "model.layers.0.self_attn.tp_divide_attrs: HeadAttention has no attribute "
        "'num_head'. Did you mean 'num_heads'?"
    )
    msg = raises(
        PlanningError,
        model,
        overrides=[{"match": "model.layers.0.self_attn", "tp_divide_attrs": ["training"]}],
    )
    assert msg.startswith(
        "model.layers.0.self_attn.tp_divide_attrs: 'training' is bool True; only integer attributes"
    )


# -------------------------------------------------------------------- coverage


def test_uncovered_parameter_and_the_suggested_fix():
    """The stray parameter's module runs outside every boundary, on activations that are
    sequence-sharded in some places and whole in others: keeping the parameter whole plans but
    does not verify with sequence parallel on, so the fix hp prints turns it off too."""
    msg = raises(UncoveredParameterError, WithStrayParameter())
    assert isinstance(UncoveredParameterError("x"), CoverageError)
    assert "inner.model.mystery_scale (replicated, shape (64,))" in msg
    fix = (
        "  - match: 'inner.model'\n    is_boundary: false\n    params: {mystery_scale: {tp: "
        "replicate}}\n"
    )
    assert f"{VERIFIED}\n{fix}and {SP_OFF}" in msg
    assert raises(UncoveredParameterError, WithStrayParameter(), sequence_parallel=False).endswith(
        f"{VERIFIED}\n{fix}".rstrip()
    )
    p = plan(
        WithStrayParameter(),
        "tp=2",
        overrides="- match: 'inner.model'\n  is_boundary: false\n  params: {mystery_scale: {tp: "
        "replicate}}\n",
    )
    assert p["inner.model"].is_boundary is False
    assert p["inner.model"].params == {
        "mystery_scale": {"tp": p["inner.model.norm"].params["weight"]["tp"]}
    }


def test_unclaimed_parameters_are_fine_when_nothing_is_sharded():
    p = plan(WithStrayParameter(), "dp=2")
    assert "inner.model" not in p


def test_trainable_parameter_left_undeclared_by_an_override():
    msg = raises(CoverageError, meta(), overrides=[{"match": "model.norm", "params": "none"}])
    assert msg.startswith(
        "trainable parameter(s) model.norm.weight are not declared by any boundary"
    )


def test_parameter_declared_twice():
    leaf = {
        "match": "model.layers.0.self_attn.q_proj",
        "params": {"weight": {"tp": "shard(0)"}},
        "in_src": "none",
        "in_dst": "none",
        "out_src": {"output": {"tp": "shard(2)"}},
        "out_dst": {"output": {"tp": "shard(2)"}},
    }
    msg = raises(CoverageError, meta(), overrides=[leaf])
    assert msg.startswith(
        "parameter model.layers.0.self_attn.q_proj.weight is declared more than once"
    )
    leaf["params"] = {"weight": {"tp": "replicate"}}
    msg = raises(CoverageError, meta(), overrides=[leaf])
    assert msg.startswith(
        "parameter model.layers.0.self_attn.q_proj.weight is declared by more than one "
        "boundary with "
        "different placements: model.layers.0.self_attn.q_proj.weight {tp: shard(0)}, "
        "model.layers.0.self_attn.q_proj.weight {tp: replicate}."
    )


def test_tied_weights_must_agree():
    msg = raises(
        CoverageError,
        meta(tie_word_embeddings=True),
        overrides=[{"match": "lm_head", "params": {"weight": {"tp": "replicate"}}}],
    )
    assert msg.startswith(
        "parameter model.embed_tokens.weight is declared by more than one boundary with different "
        "placements: model.embed_tokens.weight {tp: shard(0)}, lm_head.weight {tp: replicate}."
    )


# ---------------------------------------------------------------------- fused


def test_fused_qkv_whose_heads_cannot_be_read_and_the_suggested_fix():
    """A fused q/k/v projection with no head count anywhere (no config, no attributes): hp
    cannot tell which rows are whole heads, so it refuses and proposes keeping it whole."""
    msg = raises(FusedProjectionError, fused_qkv_lm())
    assert msg.startswith(
        "model.layers.0.self_attn.qkv_proj.weight: FusedQKVAttention: cannot read the head count"
    )
    fix = (
        "  - match: 'model.layers.0.self_attn'\n"
        "    params: {qkv_proj.weight: {tp: replicate}, o_proj.weight: {tp: replicate}}\n"
        "    in_dst: {hidden_states: {tp: replicate}}\n"
        "    out_src: {output: {tp: replicate}}\n"
        "    tp_divide_attrs: []\n"
        "    region_dispatch: false"
    )
    assert f"{VERIFIED}\n{fix}" in msg  # hp planned and verified it before printing it
    # the suggestion, pasted into an overrides list (the glob covers every layer)
    pasted = "overrides:\n" + fix.replace(
        "'model.layers.0.self_attn'", "'model.layers.*.self_attn'"
    )
    p = plan(fused_qkv_lm(2), "tp=2", overrides=pasted)
    assert p["model.layers.0.self_attn"].out_src == {"output": p["model.norm"].params["weight"]}
    assert p["model.layers.0.self_attn"]._fused_layouts == {}  # replicated: nothing to split
    # without tp there is nothing to split
    assert (
        plan(fused_qkv_lm(), "cp=2")["model.layers.0.self_attn"].params["qkv_proj.weight"]["cp"]
        is not None
    )
    plan(fused_qkv_lm(), "tp=1")


def test_fused_gate_up_under_tp_is_rearranged():
    p = plan(fused_mlp_lm(), "tp=2")
    mlp = p["model.layers.0.mlp"]
    assert mlp._fused_layouts["gate_up_proj.weight"] == {
        "kind": "gate_up",
        "dim": 0,
        "parts": [128, 128],
        "units": [128, 128],
        "names": ["gate", "up"],
    }
    assert mlp.region_dispatch is False  # chunk(2) of the re-arranged output runs locally


def test_a_real_phi3_model_under_tp():
    config = Phi3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    with torch.device("meta"):
        model = Phi3ForCausalLM(config)
    attn = plan(model, "tp=2")["model.layers.0.self_attn"]
    assert attn._fused_layouts["qkv_proj.weight"]["parts"] == [32, 16, 16]
    assert attn._fused_layouts["qkv_proj.weight"]["units"] == [4, 2, 2]
    msg = raises(FusedProjectionError, model, "tp=4")
    assert msg.startswith("model.layers.0.self_attn.qkv_proj.weight: concatenated along dim 0")


# ---------------------------------------------------------------------- flags, mesh


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"ep_size": 0}, "plan(): ep_size must be a positive integer, got 0"),
        ({"ep_size": True}, "plan(): ep_size must be a positive integer, got True"),
        ({"ep_size": 2.0}, "plan(): ep_size must be a positive integer, got 2.0"),
        (
            {"sequence_parallel": "yes"},
            "plan(): sequence_parallel must be True or False, got 'yes'",
        ),
        ({"loss_parallel": 1}, "plan(): loss_parallel must be True or False, got 1"),
    ],
)
def test_bad_flags(kwargs, text):
    assert raises(PlanningError, meta(), **kwargs) == text


def test_bad_mesh_values():
    with pytest.raises(MeshSpecError, match="is not AXIS=SIZE"):
        plan(meta(), "tp:2")
    with pytest.raises(MeshSpecError, match="expected a DeviceMesh, a MeshSpec"):
        plan(meta(), 8)


class _MeshWithoutNames:
    shape = (2,)
    mesh_dim_names = None

    def get_group(self, *args):  # pragma: no cover - never called
        raise AssertionError


def test_device_mesh_without_dim_names():
    with pytest.raises(MeshSpecError) as info:
        plan(meta(), _MeshWithoutNames())
    assert "the DeviceMesh has no mesh_dim_names; hp addresses axes by name" in str(info.value)
    assert "mesh_dim_names=('dp', 'tp')" in str(info.value)


# ------------------------------------------------------------------ templates


def test_a_template_that_returns_no_spec():
    register_template(
        BoundaryTemplate("test.bad_norm", "norm", lambda ctx: 42, architectures=("ToyCausalLM",))
    )
    msg = raises(PlanningError, head_attention_lm())
    assert msg.startswith(
        "model.layers.0.input_layernorm: template 'test.bad_norm' returned int, not a "
        "ModuleShardingSpec"
    )


def test_an_architecture_scoped_template_wins_and_none_skips_the_block():
    register_template(
        BoundaryTemplate("test.skip_norm", "norm", lambda ctx: None, architectures=("ToyCausalLM",))
    )
    model = head_attention_lm()
    for norm in (
        model.model.norm,
        *(
            m
            for layer in model.model.layers
            for m in (layer.input_layernorm, layer.post_attention_layernorm)
        ),
    ):
        norm.weight.requires_grad_(False)
    p = plan(model, "tp=2")
    assert not any(fqn.endswith("norm") for fqn in p)
    assert "model.layers.0.self_attn" in p
    # other architectures still get the built-in norm template
    assert "model.norm" in plan(meta(), "tp=2")


def test_a_template_placing_on_dp_is_refused():
    def dp_norm(ctx):
        return ModuleShardingSpec(params={"weight": {"dp": "shard(0)"}}, in_src={}, in_dst={})

    register_template(
        BoundaryTemplate("test.dp_norm", "norm", dp_norm, architectures=("ToyCausalLM",))
    )
    msg = raises(MeshAxisError, head_attention_lm(), "dp=2,tp=2")
    assert msg.startswith(
        "model.layers.0.input_layernorm.params.weight: places on the data-parallel axis 'dp'"
    )


def test_no_template_registered_for_a_kind(monkeypatch):
    rules, _ = planner_pkg._registered()
    monkeypatch.setattr(planner_pkg, "_registered", lambda: (rules, []))
    msg = raises(PlanningError, meta())
    assert msg.startswith(
        "model.embed_tokens: no boundary template for kind 'embed' is registered."
    )


def test_every_planner_error_is_a_plan_error():
    for exc in (
        PlanningError,
        DivisibilityError,
        CoverageError,
        MeshAxisError,
        FusedProjectionError,
        UncoveredParameterError,
        OverrideError,
    ):
        assert issubclass(exc, PlanError) and issubclass(exc, ValueError)


def test_input_name_that_the_forward_does_not_take(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hp_core.planner.lints import PlanningError
    from hp_core.planner.plan import plan

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    with pytest.raises(PlanningError) as e:
        plan(
            model,
            "tp=2",
            overrides=[{"match": "model.layers.0.mlp", "in_dst": {"hidden": {"tp": "replicate"}}}],
        )
    msg = str(e.value)
    assert msg.startswith(
        "model.layers.0.mlp.in_dst: the plan gives a layout to input 'hidden', which "
        "LlamaMLP.forward(x) does not take."
    )
    fix = "Fix: in your override for 'model.layers.0.mlp', name the input as the forward does "
    assert fix + "(in_dst: {x: ...})" in msg


def test_loss_parallel_refuses_a_loss_it_would_not_reproduce():
    from hp_core.testing.families import build_family

    model = build_family("llama", device="meta")
    plan(
        model, "tp=2", loss_parallel=True
    )  # the causal-LM cross-entropy: replaced by its vocab-parallel twin
    model.loss_type = "ForMaskedLM"
    with pytest.raises(
        PlanningError,
        match=r"computes its loss with transformers\.loss\.loss_utils\.ForMaskedLMLoss",
    ):
        plan(model, "tp=2", loss_parallel=True)
