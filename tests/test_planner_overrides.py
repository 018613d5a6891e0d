"""Overrides through ``plan(..., overrides=...)``: dict, list and YAML-file forms, merging
("unset inherits, set wins"), inserts, globs and ``when:`` guards."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from hp_core import plan
from hp_core.plans import OverrideMatchWarning, dump_plan, load_plan
from hp_core.presets import build_model
from hp_core.spec import ModuleShardingSpec
from tests._planner_helpers import (
    L,
    builtin_only,  # noqa: F401  (fixture)
    contract,
)
from tests._toy_models import head_attention_lm

pytestmark = pytest.mark.usefixtures("builtin_only")


def meta(family: str = "llama", **kw) -> torch.nn.Module:
    return build_model(family, device="meta", **kw)


REPLICATED_MLP_OUT = {"output": L(tp="replicate")}


def test_dict_form_with_a_glob_merges_into_every_match_and_inherits_the_rest():
    override = ModuleShardingSpec(out_dst={"output": {"tp": Replicate()}})
    snapshot = copy.deepcopy(override)
    base = plan(meta(), "tp=2")
    p = plan(meta(), "tp=2", overrides={"model.layers.*.mlp": override})
    for i in range(2):
        got = contract(p[f"model.layers.{i}.mlp"])
        want = contract(base[f"model.layers.{i}.mlp"])
        assert got == {**want, "out_dst": REPLICATED_MLP_OUT}
    assert p["model.layers.0.self_attn"] == base["model.layers.0.self_attn"]
    assert override == snapshot  # user specs are never mutated
    assert plan(meta(), "tp=2", overrides={"model.layers.*.mlp": override}) == p


def test_list_form_exact_key_replaces_the_whole_field_and_notes_what_was_dropped():
    entries = [
        {
            "match": "model.layers.0.self_attn",
            "params": {
                "q_proj.weight": {"tp": "shard(0)"},
                "k_proj.weight": {"tp": "replicate"},
                "v_proj.weight": {"tp": "replicate"},
                "o_proj.weight": {"tp": "shard(1)"},
            },
        },
        {"match": "lm_head", "out_dst": {"tp": "shard(2)"}},  # scalar shorthand
    ]
    p = plan(meta(), "tp=2", overrides=entries)
    assert p["model.layers.0.self_attn"].params["k_proj.weight"] == {"tp": Replicate()}
    assert p["model.layers.1.self_attn"].params["k_proj.weight"] == {"tp": Shard(0)}
    assert p["lm_head"].out_dst == {"output": {"tp": Shard(2)}}
    assert p["lm_head"]._is_terminal is True  # internals always come from the derived spec
    assert p.notes == []  # same keys: nothing dropped
    p2 = plan(
        meta(),
        "tp=2",
        overrides=[
            {"match": "model.norm", "out_names": ["output"]},
            {
                "match": "model.layers.0.self_attn",
                "in_src": {"attention_mask": {"tp": "replicate"}},
            },
        ],
    )
    assert p2["model.norm"].out_names == ["output"]
    assert p2.notes == [
        "overrides[1]: model.layers.0.self_attn.in_src: override replaces the whole field; "
        "dropped keys ['hidden_states']"
    ]


def test_sentinels_auto_and_none():
    model = meta()
    model.model.norm.weight.requires_grad_(False)  # a frozen parameter needs no declaration
    p = plan(
        model, "tp=2", overrides=[{"match": "model.norm", "params": "none", "out_dst": "auto"}]
    )
    assert p["model.norm"].params == {}
    assert p["model.norm"].out_dst == {"output": L(tp="shard(1)")}
    assert p.notes == [
        "overrides[0]: model.norm.params: cleared by 'none' (derived value {'weight': {'tp': "
        "Replicate()}} dropped)"
    ]


def test_yaml_file_form_with_when_guards(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(
        "overrides:\n"
        "  - match: model.layers.*.mlp\n"
        "    when: sp\n"
        "    out_dst: {output: {tp: replicate}}\n"
        "  - match: model.norm\n"
        "    when: cp\n"
        "    params: {weight: {cp: replicate, tp: replicate}}\n"
        "    in_src: {hidden_states: {cp: shard(1), tp: replicate}}\n"
    )
    p = plan(meta(), "tp=2", overrides=path)
    assert p["model.layers.1.mlp"].out_dst == REPLICATED_MLP_OUT
    assert p["model.norm"].in_src == {"hidden_states": L(tp="shard(1)")}  # cp inactive: skipped
    assert p.notes == ["overrides[1]: skipped ('model.norm' when: cp; cp is not active)"]
    assert plan(meta(), "tp=2", overrides=str(path)) == p  # a str path works too

    no_sp = plan(meta(), "tp=2", overrides=path, sequence_parallel=False)
    assert no_sp["model.layers.1.mlp"].out_dst == REPLICATED_MLP_OUT  # derived value already
    assert [n.split(":")[0] for n in no_sp.notes] == ["overrides[0]", "overrides[1]"]
    assert "sp is not active" in no_sp.notes[0]

    with_cp = plan(meta(), "tp=2,cp=2", overrides=path)
    assert with_cp["model.norm"].in_src == {"hidden_states": L(cp="shard(1)", tp="replicate")}
    assert with_cp.notes == []


def test_yaml_text_form_and_when_ep():
    text = "- match: model.layers.*.mlp\n  when: ep\n  region_dispatch: false\n"
    assert plan(meta("qwen2moe"), "tp=2", overrides=text).notes == [
        "overrides[0]: skipped ('model.layers.*.mlp' when: ep; ep is not active)"
    ]
    p = plan(meta("qwen2moe"), "tp=2", overrides=text, ep_size=2)
    assert p.notes == [] and p["model.layers.0.mlp"].region_dispatch is False


def test_when_tp_is_skipped_on_a_cp_only_mesh():
    p = plan(
        meta(),
        "cp=2",
        overrides=[{"match": "lm_head", "when": "tp", "params": {"weight": {"tp": "shard(0)"}}}],
    )
    assert p["lm_head"].params == {"weight": L(cp="replicate")}


def test_exact_key_on_a_non_boundary_inserts_a_new_boundary_in_model_order():
    insert = {
        "match": "model.rotary_emb",
        "params": "none",
        "in_src": "none",
        "in_dst": "none",
        "out_src": {"output": {"tp": "replicate"}},
        "out_dst": {"output": {"tp": "replicate"}},
        "region_dispatch": False,
    }
    p = plan(meta(), "tp=2", overrides=[insert])
    order = list(p)
    assert order.index("model.norm") < order.index("model.rotary_emb") < order.index("lm_head")
    assert contract(p["model.rotary_emb"]) == {
        "params": {},
        "in_src": {},
        "in_dst": {},
        "out_src": {"output": L(tp="replicate")},
        "out_dst": {"output": L(tp="replicate")},
        "region_dispatch": False,
    }
    assert "overrides[0]: inserted a new boundary at 'model.rotary_emb'" in p.notes


def test_glob_matching_no_boundary_warns_and_changes_nothing():
    with pytest.warns(
        OverrideMatchWarning, match=r"glob 'model.layers.\*.experts' matched no derived boundary"
    ):
        p = plan(
            meta(),
            "tp=2",
            overrides=[{"match": "model.layers.*.experts", "region_dispatch": False}],
        )
    assert p.modules == plan(meta(), "tp=2").modules


def test_tp_divide_attrs_and_head_counts_become_a_tp_local_attr_plan():
    model = head_attention_lm()
    p = plan(model, "tp=2")
    assert p["model.layers.0.self_attn"]._tp_local_attr_plan == {
        "num_heads": (4, 2),
        "num_key_value_heads": (2, 1),
    }
    assert p["model.layers.0.mlp"]._tp_local_attr_plan is None
    model.model.layers[0].mlp.groups = 4
    p = plan(
        model, "tp=2", overrides=[{"match": "model.layers.0.mlp", "tp_divide_attrs": ["groups"]}]
    )
    assert p["model.layers.0.mlp"]._tp_local_attr_plan == {"groups": (4, 2)}
    p = plan(
        model,
        "tp=2",
        overrides=[{"match": "model.layers.0.self_attn", "tp_divide_attrs": ["head_dim"]}],
    )
    assert p["model.layers.0.self_attn"]._tp_local_attr_plan == {
        "num_heads": (4, 2),
        "num_key_value_heads": (2, 1),
        "head_dim": (16, 8),
    }
    # head counts are only divided when q/k/v are tp-sharded, and never without tp
    assert plan(model, "cp=2")["model.layers.0.self_attn"]._tp_local_attr_plan is None
    replicated = {
        k: {"tp": "replicate"}
        for k in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")
    }
    p = plan(model, "tp=2", overrides=[{"match": "model.layers.0.self_attn", "params": replicated}])
    assert p["model.layers.0.self_attn"]._tp_local_attr_plan is None
    assert p["model.layers.0.self_attn"]._deferred_bias_params == ()


def test_hf_models_have_no_head_attributes_to_divide():
    p = plan(meta(), "tp=2")
    assert all(s._tp_local_attr_plan is None for s in p.modules.values())


def test_a_planned_plan_round_trips_through_yaml():
    p = plan(
        meta("qwen2moe"),
        "tp=2,cp=2",
        ep_size=2,
        overrides=[{"match": "model.norm", "region_dispatch": False}],
    )
    assert load_plan(dump_plan(p)) == p
    assert load_plan(dump_plan(p)).fingerprint() == p.fingerprint()
