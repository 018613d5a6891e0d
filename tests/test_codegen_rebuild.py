"""rebuild: every malformed or non-canonical meta is refused by path; model metadata is
re-derived."""

from __future__ import annotations

import copy

import pytest

from hp_core import ModuleShardingSpec, ShardingPlan, plan
from hp_core.artifact import (
    MetaError,
    ModelMismatchError,
    freeze,
    rebuild,
    restore_model_metadata,
    same_plan,
)
from hp_core.planner.lints import DivisibilityError
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)
from tests._toy_models import head_attention_lm

pytestmark = pytest.mark.usefixtures("builtin_only")


def _meta() -> dict:
    spec = ModuleShardingSpec(
        params={"w": {"tp": "shard(0)"}},
        out_src={"tp": "partial"},
        inner_wrapper="w",
        inner_target="self",
        region_dispatch=False,
    )
    return freeze(ShardingPlan({"a": spec, "b": ModuleShardingSpec(params={})}, ("tp",), (2,)))


def _refused(meta, message: str) -> None:
    with pytest.raises(MetaError) as info:
        rebuild(meta)
    assert str(info.value) == message


def _edit(edit) -> dict:
    meta = copy.deepcopy(_meta())
    edit(meta)
    return meta


def test_the_base_meta_rebuilds():
    assert freeze(rebuild(_meta())) == _meta()


def test_top_level_shape():
    _refused([], "meta: expected a mapping, got list.")
    _refused(
        _edit(lambda m: m.update(injection=[])),
        "meta: unknown key 'injection'. Did you mean 'injections'? Valid keys: mesh, "
        "sequence_parallel, loss_parallel, ep_size, param_plan, injections.",
    )
    _refused(
        _edit(lambda m: m.update({"zzz": 1})),
        "meta: unknown key 'zzz'. Valid keys: mesh, sequence_parallel, loss_parallel, "
        "ep_size, param_plan, injections.",
    )
    _refused(
        _edit(lambda m: m.pop("injections")),
        "meta: missing key(s) injections; a meta is what freeze(plan) returns.",
    )
    _refused(
        _edit(lambda m: m.update(injections={})),
        "injections: expected a list of {match: FQN, ...} rules, got {}.",
    )


def test_rules():
    _refused(
        _edit(lambda m: m["param_plan"].append("c")),
        "param_plan[2]: expected a mapping with a string 'match' (a module FQN), got 'c'.",
    )
    _refused(
        _edit(lambda m: m["param_plan"].append({"params": {}})),
        "param_plan[2]: expected a mapping with a string 'match' (a module FQN), got "
        "{'params': {}}.",
    )
    _refused(
        _edit(lambda m: m["param_plan"].append({"match": "a", "is_boundary": True})),
        "param_plan[2] ('a'): a second rule for 'a' in param_plan; each module has at most one.",
    )
    _refused(
        _edit(lambda m: m["param_plan"][0].update(inner_target="self")),
        "param_plan[0] ('a'): unknown key 'inner_target'. It belongs in injections. Valid "
        "keys: match, params, in_src, in_dst, out_src, out_dst, out_names, tp_divide_attrs, "
        "is_boundary, region_dispatch, deferred_bias_params, skip_source_lowering.",
    )
    _refused(
        _edit(lambda m: m["param_plan"][0].update(param={})),
        "param_plan[0] ('a'): unknown key 'param'. Did you mean 'params'? Valid keys: match, "
        "params, in_src, in_dst, out_src, out_dst, out_names, tp_divide_attrs, is_boundary, "
        "region_dispatch, deferred_bias_params, skip_source_lowering.",
    )
    _refused(
        _edit(lambda m: m["injections"][0].update(zzz=1)),
        "injections[0] ('a'): unknown key 'zzz'. Valid keys: match, inner_wrapper, "
        "inner_target, inner_out_src, local_compute_fn, ep_stack, ep_size, fused_layouts.",
    )
    _refused(
        _edit(lambda m: m["injections"].append({"match": "c", "ep_size": 2})),
        "injections[1] ('c'): 'c' has no param_plan rule; every planned module has one.",
    )


def test_mesh_and_plan_level_values():
    _refused(
        _edit(lambda m: m.update(mesh=["tp"])),
        "mesh: expected {axis_names: [...], shape: [...]}, got ['tp'].",
    )
    _refused(
        _edit(lambda m: m["mesh"].update(sizes=[2])),
        "mesh: expected {axis_names: [...], shape: [...]}, got {'axis_names': ['tp'], "
        "'shape': [2], 'sizes': [2]}.",
    )
    _refused(
        _edit(lambda m: m["mesh"].update(shape=[2, 2])),
        "mesh_shape: 2 size(s) [2, 2] for 1 axis name(s) ['tp']; give one size per axis, in "
        "the same order.",
    )
    _refused(
        _edit(lambda m: m.update(sequence_parallel="yes")),
        "sequence_parallel: expected true or false, got str 'yes'.",
    )
    _refused(_edit(lambda m: m.update(ep_size=0)), "ep_size: expected a positive integer, got 0.")
    _refused(
        _edit(lambda m: m.update(ep_size=1.0)), "ep_size: expected a positive integer, got 1.0."
    )


@pytest.mark.parametrize(
    "group,key,value,message",
    [
        (
            "param_plan",
            "params",
            [],
            "param_plan[0] ('a').params: expected a mapping of name to {axis: placement}, got [].",
        ),
        (
            "param_plan",
            "params",
            {"": {"tp": "replicate"}},
            "param_plan[0] ('a').params: keys must be non-empty strings, got ''.",
        ),
        (
            "param_plan",
            "params",
            {"w": {"tp": "shrd(0)"}},
            "param_plan[0] ('a').params.w.tp: 'shrd(0)' is not a placement. Grammar: "
            "replicate | partial | shard(N)  (N a non-negative integer; case and spaces "
            "ignored). Example: 'shard(1)'.",
        ),
        (
            "param_plan",
            "in_src",
            {"x": {}},
            "param_plan[0] ('a').in_src.x: expected a non-empty mapping of mesh axis to "
            "placement, e.g. {tp: shard(1)}, got {}. Placement grammar: replicate | partial "
            "| shard(N)  (N a non-negative integer; case and spaces ignored).",
        ),
        (
            "param_plan",
            "out_names",
            "output",
            "param_plan[0] ('a').out_names: expected a list of names, got 'output'.",
        ),
        (
            "param_plan",
            "deferred_bias_params",
            ["", "b"],
            "param_plan[0] ('a').deferred_bias_params[0]: expected a non-empty string, got ''.",
        ),
        (
            "param_plan",
            "is_boundary",
            1,
            "param_plan[0] ('a').is_boundary: expected true or false, got 1.",
        ),
        (
            "param_plan",
            "region_dispatch",
            [False],
            "param_plan[0] ('a').region_dispatch: expected a boolean, number or string, got "
            "[False].",
        ),
        (
            "param_plan",
            "region_dispatch",
            None,
            "param_plan[0] ('a').region_dispatch: expected a boolean, number or string, got None.",
        ),
        (
            "param_plan",
            "region_dispatch",
            "no",
            "param_plan[0] ('a'): region_dispatch: expected True, False or None, got 'no'.",
        ),
        (
            "injections",
            "inner_wrapper",
            3,
            "injections[0] ('a').inner_wrapper: expected a registry name, {_target_: "
            "NAME_OR_PATH, ...} or a layout, got 3.",
        ),
        (
            "injections",
            "inner_wrapper",
            {"_target_": ""},
            "injections[0] ('a').inner_wrapper: Target: _target_ must be a non-empty string, "
            "got ''.",
        ),
        (
            "injections",
            "inner_wrapper",
            {"_target_": "w", "k": object},
            "injections[0] ('a').inner_wrapper.k: type <class 'object'> has no JSON form; an "
            "artifact holds strings, numbers, booleans, null, lists and string-keyed "
            "mappings.",
        ),
        (
            "injections",
            "inner_wrapper",
            {"x": {"tp": "replicate"}},
            "param_plan[0] ('a'): inner_wrapper: expected a registry name, a decorated "
            "function or a Target, got {'x': {'tp': Replicate()}}.",
        ),
        (
            "injections",
            "inner_out_src",
            {"tp": "shard(1)"},
            "injections[0] ('a').inner_out_src.tp: expected a non-empty mapping of mesh axis "
            "to placement, e.g. {tp: shard(1)}, got 'shard(1)'. Placement grammar: replicate "
            "| partial | shard(N)  (N a non-negative integer; case and spaces ignored).",
        ),
        (
            "injections",
            "ep_stack",
            ["w"],
            "injections[0] ('a').ep_stack: expected a mapping, got ['w'].",
        ),
        (
            "injections",
            "ep_size",
            True,
            "injections[0] ('a').ep_size: expected a non-negative integer, got True.",
        ),
        (
            "injections",
            "ep_size",
            -1,
            "injections[0] ('a').ep_size: expected a non-negative integer, got -1.",
        ),
    ],
)
def test_values_are_checked_by_their_rebuild_kind(group, key, value, message):
    _refused(_edit(lambda m: m[group][0].update({key: value})), message)


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda m: m["param_plan"][0]["params"]["w"].update(tp="SHARD(0)"),
            "meta.param_plan[0].params.w.tp: not in canonical form: the meta has 'SHARD(0)' "
            "where freeze writes 'shard(0)'.",
        ),
        (
            lambda m: m["param_plan"][1].update(out_names=[]),
            "meta.param_plan[1].out_names: not in canonical form: the meta has [] where "
            "freeze writes MISSING.",
        ),
        (
            lambda m: m["injections"][0].update(ep_size=0),
            "meta.injections[0].ep_size: not in canonical form: the meta has 0 where freeze "
            "writes MISSING.",
        ),
        (
            lambda m: m["injections"].append({"match": "b"}),
            "meta.injections: not in canonical form: the meta has [{'match': 'a', "
            "'inner_wrapper': 'w', 'inner_target': 'self'}, {'match': 'b'}] where freeze "
            "writes [{'match': 'a', 'inner_wrapper': 'w', 'inner_target': 'self'}].",
        ),
        (
            lambda m: m["injections"].insert(0, {"match": "b", "ep_size": 2}),
            "meta.injections[0].match: not in canonical form: the meta has 'b' where freeze "
            "writes 'a'.",
        ),
        (
            lambda m: m["param_plan"][1].pop("is_boundary"),
            "meta.param_plan[1].is_boundary: not in canonical form: the meta has MISSING "
            "where freeze writes True.",
        ),
        (
            lambda m: m["param_plan"][0].update(deferred_bias_params=[]),
            "meta.param_plan[0].deferred_bias_params: not in canonical form: the meta has [] "
            "where freeze writes MISSING.",
        ),
        (
            lambda m: m["injections"][0].update(ep_stack={}),
            "meta.injections[0].ep_stack: not in canonical form: the meta has {} where "
            "freeze writes MISSING.",
        ),
    ],
)
def test_a_non_canonical_meta_is_refused(edit, message):
    _refused(
        _edit(edit),
        message + " An artifact is written by hp freeze and never edited; re-create it instead.",
    )


def test_a_meta_that_does_not_freeze_back_is_refused():
    layouts = {"b": {"tp": "shard(1)"}, "a": {"tp": "shard(1)"}}
    meta = _edit(lambda m: m["param_plan"][1].update(out_src=layouts, out_dst=layouts))
    _refused(
        meta,
        "modules['b']: its outputs ['b', 'a'] are ordered only by the key order of out_src, "
        "which an artifact does not keep (canonical JSON sorts keys). Declare the order: add "
        "out_names: ['b', 'a'] to the override for 'b'.",
    )


def test_tp_local_attributes_are_re_derived_from_the_model():
    model = head_attention_lm()
    live = plan(model, "tp=2")
    attn = "model.layers.0.self_attn"
    assert live[attn]._tp_local_attr_plan == {"num_heads": (4, 2), "num_key_value_heads": (2, 1)}
    meta = freeze(live)
    assert rebuild(meta)[attn]._tp_local_attr_plan is None  # exempt: not in the artifact
    restored = rebuild(meta, model=model)
    assert {f: s._tp_local_attr_plan for f, s in restored.items()} == {
        f: s._tp_local_attr_plan for f, s in live.items()
    }
    assert same_plan(live, restored)


def test_restore_checks_the_model():
    model = head_attention_lm()
    p = rebuild(freeze(plan(model, "tp=2")))
    with pytest.raises(
        ModelMismatchError,
        match=r"^the plan names module\(s\) the model lacks: \['model.layers.1', "
        r"'model.layers.1.input_layernorm', 'model.layers.1.self_attn', "
        r"'model.layers.1.post_attention_layernorm', 'model.layers.1.mlp'\]\. Closest "
        r"module: 'model.layers.0'\. Was it made for another model\?$",
    ):
        restore_model_metadata(p, head_attention_lm(n_layers=1))
    with pytest.raises(
        DivisibilityError, match=r"model.layers.0.self_attn.num_heads = 6 is not divisible by tp=4"
    ):
        restore_model_metadata(
            ShardingPlan(dict(p.modules), ("tp",), (4,)), head_attention_lm(heads=6, kv_heads=6)
        )
    no_tp = ShardingPlan(dict(p.modules), ("cp",), (2,))
    assert restore_model_metadata(no_tp, model) is no_tp
    assert no_tp["model.layers.0.self_attn"]._tp_local_attr_plan is None
    tp1 = ShardingPlan(dict(p.modules), ("tp",), (1,))
    assert (
        restore_model_metadata(tp1, model)["model.layers.0.self_attn"]._tp_local_attr_plan is None
    )
