"""The YAML / dict form of a ShardingPlan: round trips and every error path."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from hp_core.injection import Target, inner_wrapper
from hp_core.plans import (
    PlanError,
    PlanYAMLError,
    ShardingPlan,
    dump_plan,
    load_plan,
    plan_from_dict,
    plan_to_dict,
)
from hp_core.spec import ModuleShardingSpec


@inner_wrapper
def my_wrapper(target_module, ctx):
    return None


def full_plan() -> ShardingPlan:
    attn = ModuleShardingSpec(
        params={"q_proj.weight": {"tp": Shard(0)}, "o_proj.weight": {"tp": Shard(1)}},
        in_src={"hidden_states": {"tp": Shard(1), "cp": Shard(1)}},
        in_dst={"hidden_states": {"tp": Replicate(), "cp": Shard(1)}},
        out_src={"tp": Partial(), "cp": Shard(1)},
        out_dst={"output": {"tp": Shard(1)}},
        out_names=["output", "weights"],
        tp_divide_attrs=[],
        region_dispatch=False,
        inner_target="attn",
        inner_wrapper=Target("sdpa_qkv", {"block": 64, "scale": 0.5, "flags": [1, 2]}),
        inner_out_src={"hidden": {"cp": Shard(1)}},
    )
    attn._tp_local_attr_plan = {"num_heads": (8, 2), "num_key_value_heads": (4, 1)}
    attn._deferred_bias_params = ("o_proj.bias",)
    attn._needs_cp_attn = True
    moe = ModuleShardingSpec(
        params={"experts.w": {"ep": Shard(0)}},
        in_src={},
        in_dst={},
        out_src="none",
        out_dst="auto",
        local_compute_fn="qwen2moe",
        region_dispatch=False,
        skip_source_lowering=True,
    )
    moe._ep_stack = {"experts.w": ["experts.0.w", "experts.1.w"]}
    moe._ep_size = 2
    head = ModuleShardingSpec(
        params={"weight": {"tp": Shard(0)}}, in_src={}, in_dst={}, is_boundary=False
    )
    head._is_terminal = True
    head._tp_local_attr_plan = {}
    return ShardingPlan(
        modules={
            "model.layers.0.self_attn": attn,
            "model.layers.0.mlp": moe,
            "lm_head": head,
            "": ModuleShardingSpec(),
        },
        mesh_axis_names=("tp", "cp", "ep"),
        mesh_shape=(2, 2, 2),
        sequence_parallel=True,
        loss_parallel=True,
        ep_size=2,
    )


# ------------------------------------------------------------------ round trip


def test_dump_load_is_identity_and_byte_stable():
    plan = full_plan()
    text = dump_plan(plan)
    loaded = load_plan(text)
    assert loaded == plan
    assert list(loaded) == list(plan)
    assert dump_plan(loaded) == text
    assert load_plan(dump_plan(loaded)) == loaded
    assert loaded.fingerprint() == plan.fingerprint()


def test_dump_layout_and_internal_section():
    text = dump_plan(full_plan())
    assert text.startswith("version: 1\nmesh:\n  axis_names: [tp, cp, ep]\n  shape: [2, 2, 2]\n")
    assert "      q_proj.weight: {tp: shard(0)}\n" in text
    assert "    out_src:\n      output: {tp: partial, cp: shard(1)}\n" in text
    assert "    out_src: none\n    out_dst: auto\n" in text
    assert (
        "    inner_wrapper:\n      _target_: sdpa_qkv\n      block: 64\n      scale: 0.5\n   "
        "   flags: [1, 2]\n" in text
    )
    assert "    local_compute_fn: qwen2moe\n" in text
    assert "    tp_divide_attrs: []\n" in text
    assert "    _internal:\n      tp_local_attr_plan:\n        num_heads: [8, 2]\n" in text
    assert "      tp_local_attr_plan: {}\n      is_terminal: true\n" in text
    assert "  ? ''\n  : {}\n" in text  # the root module's FQN is the empty string
    assert "_resolved" not in text


def test_dict_form_round_trip():
    plan = full_plan()
    data = plan_to_dict(plan)
    assert data["modules"]["lm_head"]["is_boundary"] is False
    assert "is_boundary" not in data["modules"]["model.layers.0.self_attn"]
    assert data["modules"]["model.layers.0.mlp"]["_internal"] == {
        "ep_stack": {"experts.w": ["experts.0.w", "experts.1.w"]},
        "ep_size": 2,
    }
    assert plan_from_dict(data) == plan


def test_explicit_empty_and_none_values_survive():
    plan = ShardingPlan(
        {"a": ModuleShardingSpec(params={}, tp_divide_attrs=[]), "b": ModuleShardingSpec()}, ("tp",)
    )
    loaded = load_plan(dump_plan(plan))
    assert loaded["a"].params == {} and loaded["a"].tp_divide_attrs == []
    assert loaded["b"].params is None and loaded["b"].tp_divide_attrs is None
    assert loaded.mesh_shape is None
    assert "shape" not in plan_to_dict(plan)["mesh"]


def test_resolved_fields_are_not_serialized():
    plan = full_plan()
    plan["lm_head"]._resolved_inner_wrapper = my_wrapper
    plan["lm_head"]._resolved_inner_target = "self"
    loaded = load_plan(dump_plan(plan))
    assert loaded["lm_head"]._resolved_inner_wrapper is None
    assert loaded["lm_head"]._resolved_inner_target is None


def test_callable_is_written_as_dotted_target():
    plan = full_plan()
    plan["model.layers.0.self_attn"].inner_wrapper = my_wrapper
    text = dump_plan(plan)
    dotted = f"{my_wrapper.__module__}.my_wrapper"
    assert f"inner_wrapper: {{_target_: {dotted}}}" in text
    loaded = load_plan(text)
    assert loaded["model.layers.0.self_attn"].inner_wrapper == Target(dotted)
    assert dump_plan(loaded) == text


def test_non_importable_callable_cannot_be_dumped():
    @inner_wrapper
    def local(target_module, ctx):
        return None

    plan = full_plan()
    plan["model.layers.0.self_attn"].inner_wrapper = local
    with pytest.raises(PlanYAMLError) as info:
        dump_plan(plan)
    msg = str(info.value)
    assert msg.startswith("modules['model.layers.0.self_attn'].inner_wrapper: ")
    assert "<locals>.local cannot be written to a file" in msg
    assert "Register it under a name" in msg


def test_partial_cannot_be_dumped():
    import functools

    plan = full_plan()
    plan["lm_head"].inner_wrapper = functools.partial(my_wrapper)
    with pytest.raises(
        PlanYAMLError,
        match=r"^modules\['lm_head'\]\.inner_wrapper: functools\.partial cannot be written",
    ):
        dump_plan(plan)


def test_uncallable_injection_cannot_be_dumped():
    plan = full_plan()
    plan["lm_head"].local_compute_fn = 3
    with pytest.raises(
        PlanYAMLError, match=r"^modules\['lm_head'\]\.local_compute_fn: expected a registry name"
    ):
        dump_plan(plan)


def test_placement_without_dsl_form_cannot_be_dumped():
    plan = full_plan()
    plan["lm_head"].params = {"weight": {"tp": Partial("avg")}}
    with pytest.raises(
        PlanYAMLError,
        match=(
            r"^modules\['lm_head'\]\.params\.weight\.tp: placement Partial\(avg\) "
            r"has no DSL form"
        ),
    ):
        dump_plan(plan)


def test_strings_assigned_after_construction_are_canonicalized_or_rejected():
    plan = full_plan()
    plan["lm_head"].params = {"weight": {"tp": " Shard( 0 ) "}}
    assert "weight: {tp: shard(0)}" in dump_plan(plan)
    plan["lm_head"].params = {"weight": {"tp": "sharded"}}
    with pytest.raises(
        PlanYAMLError,
        match=r"^modules\['lm_head'\]\.params\.weight\.tp: 'sharded' is not a placement",
    ):
        dump_plan(plan)
    plan["lm_head"].params = {"weight": "tp"}
    with pytest.raises(
        PlanYAMLError,
        match=r"^modules\['lm_head'\]\.params\.weight: expected an \{axis: placement\}",
    ):
        dump_plan(plan)
    plan["lm_head"].params = ["weight"]
    with pytest.raises(
        PlanYAMLError, match=r"^modules\['lm_head'\]\.params: expected a mapping of name"
    ):
        dump_plan(plan)


def test_target_config_must_be_plain_data():
    plan = full_plan()
    plan["lm_head"].local_compute_fn = Target("x", {"obj": object()})
    with pytest.raises(PlanYAMLError, match="cannot be written as YAML"):
        dump_plan(plan)


def test_plan_to_dict_rejects_non_plans():
    with pytest.raises(PlanYAMLError, match="plan_to_dict: expected a ShardingPlan, got dict"):
        plan_to_dict({})


def test_hand_written_yaml_is_normalized():
    text = """
    version: 1
    mesh: {axis_names: [tp]}
    modules:
      model.layers.0.mlp:
        params:
          up_proj.weight: {tp: Shard( 0 )}
        in_src: {x: {tp: REPLICATE}}
        in_dst: {x: {tp: replicate}}
        out_src: {tp: partial}
        out_dst: {tp: shard(1)}
        inner_out_src: {tp: shard(1)}
    """
    plan = load_plan(textwrap.dedent(text))
    spec = plan["model.layers.0.mlp"]
    assert spec.params == {"up_proj.weight": {"tp": Shard(0)}}
    assert spec.in_src == {"x": {"tp": Replicate()}}
    assert spec.out_src == {"output": {"tp": Partial()}}
    assert spec.inner_out_src == {"output": {"tp": Shard(1)}}
    assert (plan.sequence_parallel, plan.loss_parallel, plan.ep_size) == (False, False, 1)


# ------------------------------------------------------------------------ files


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_load_from_path_and_str_path(tmp_path: Path, suffix):
    plan = full_plan()
    file = tmp_path / f"plan{suffix}"
    file.write_text(dump_plan(plan), encoding="utf-8")
    assert load_plan(file) == plan
    assert load_plan(str(file)) == plan


def test_load_json_file(tmp_path: Path):
    import json

    plan = full_plan()
    file = tmp_path / "plan.json"
    file.write_text(json.dumps(plan_to_dict(plan)), encoding="utf-8")
    assert load_plan(file) == plan


def test_existing_file_without_suffix(tmp_path: Path):
    file = tmp_path / "PLAN"
    file.write_text(dump_plan(full_plan()), encoding="utf-8")
    assert load_plan(str(file)) == full_plan()


def test_missing_file(tmp_path: Path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(PlanYAMLError, match=r"nope\.yaml: no such file \(reading a plan\)"):
        load_plan(str(missing))


def test_unreadable_and_non_utf8_files(tmp_path: Path):
    with pytest.raises(PlanYAMLError, match="cannot read a plan"):
        load_plan(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"version: 1\n\xff\xfe")
    with pytest.raises(
        PlanYAMLError, match=r"bad\.yaml: not UTF-8 text \(invalid start byte at byte 11\)"
    ):
        load_plan(bad)


def test_wrong_source_type():
    with pytest.raises(
        PlanYAMLError, match=r"a plan: expected YAML text or a file path, got int 3"
    ):
        load_plan(3)


def test_errors_from_a_file_name_the_file(tmp_path: Path):
    file = tmp_path / "plan.yaml"
    file.write_text("version: 2\nmesh: {axis_names: [tp]}\nmodules: {}\n", encoding="utf-8")
    with pytest.raises(PlanYAMLError, match=rf"^version: unsupported .* \(in {file}\)$"):
        load_plan(file)


# -------------------------------------------------------------- syntax errors


def test_yaml_syntax_error_carries_file_and_line(tmp_path: Path):
    file = tmp_path / "broken.yaml"
    file.write_text("version: 1\nmesh: {axis_names: [tp]\nmodules: {}\n", encoding="utf-8")
    with pytest.raises(PlanYAMLError) as info:
        load_plan(file)
    msg = str(info.value)
    assert msg.startswith(f"{file}:3:")
    assert "invalid YAML" in msg and "while parsing a flow mapping" in msg


def test_yaml_syntax_error_in_text():
    with pytest.raises(PlanYAMLError, match=r"^<string>:2:\d+: invalid YAML: "):
        load_plan("version: 1\n  mesh: [\n")


def test_several_documents_are_an_error():
    with pytest.raises(
        PlanYAMLError, match=r"^<string>:2:1: invalid YAML: but found another document"
    ):
        load_plan("version: 1\n---\nversion: 1\n")


def test_yaml_error_without_mark():
    with pytest.raises(
        PlanYAMLError, match=r"^<string>: invalid YAML: unacceptable character #x0007"
    ):
        load_plan("version: \x07\n")


def test_duplicate_top_level_key():
    text = "version: 1\nmesh: {axis_names: [tp]}\nmodules: {}\nversion: 1\n"
    with pytest.raises(
        PlanYAMLError,
        match=r"^<string>:4:1: invalid YAML: duplicate key 'version' \(first at line 1\)",
    ):
        load_plan(text)


def test_duplicate_nested_key():
    text = "version: 1\nmesh: {axis_names: [tp]}\nmodules:\n  a:\n    params: {}\n    params: {}\n"
    with pytest.raises(PlanYAMLError, match=r"^<string>:6:5: invalid YAML: duplicate key 'params'"):
        load_plan(text)


def test_merge_keys_are_not_duplicates():
    text = textwrap.dedent(
        """
        version: 1
        mesh: {axis_names: [tp]}
        modules:
          a: &base {params: {}, in_src: {}}
          b:
            <<: *base
            params: {w: {tp: shard(0)}}
        """
    )
    plan = load_plan(text)
    assert plan["b"].params == {"w": {"tp": Shard(0)}} and plan["b"].in_src == {}


def test_unhashable_key_is_a_yaml_error():
    with pytest.raises(PlanYAMLError, match=r"invalid YAML: found unhashable key"):
        load_plan("? [a]\n: 1\n")


# ---------------------------------------------------------- document errors


def _doc(**modules_or_top) -> dict:
    base = {"version": 1, "mesh": {"axis_names": ["tp"], "shape": [2]}, "modules": {}}
    base.update(modules_or_top)
    return base


@pytest.mark.parametrize(
    "data, message",
    [
        ([1], r"^plan: expected a mapping with keys version, mesh, sequence_parallel"),
        (
            _doc(modules_={}),
            r"^plan: unknown key 'modules_'\. Did you mean 'modules'\? Valid keys: version, mesh",
        ),
        (
            {"mesh": {"axis_names": ["tp"]}, "modules": {}},
            r"^version: missing required top-level key",
        ),
        ({"version": 1, "modules": {}}, r"^mesh: missing required top-level key"),
        (
            {"version": 1, "mesh": {"axis_names": ["tp"]}},
            r"^modules: missing required top-level key",
        ),
        (_doc(version=2), r"^version: unsupported plan format version 2; this hp reads version 1"),
        (_doc(version=True), r"^version: unsupported plan format version True"),
        (
            _doc(mesh=["tp"]),
            r"^mesh: expected \{axis_names: \[\.\.\.\], shape: \[\.\.\.\]\}, got list",
        ),
        (
            _doc(mesh={"axis_name": ["tp"]}),
            r"^mesh: unknown key 'axis_name'\. Did you mean 'axis_names'\?",
        ),
        (
            _doc(mesh={"shape": [2]}),
            r"^mesh\.axis_names: missing; list the mesh axes in mesh order",
        ),
        (_doc(mesh={"axis_names": "tp"}), r"^mesh\.axis_names: expected a list of mesh axis names"),
        (
            _doc(mesh={"axis_names": ["tp", 3]}),
            r"^mesh\.axis_names\[1\]: expected a non-empty axis name, got 3",
        ),
        (
            _doc(mesh={"axis_names": ["tp"], "shape": [2, 2]}),
            r"^mesh\.shape: 2 size\(s\) \[2, 2\] for 1 axis name",
        ),
        (
            _doc(mesh={"axis_names": ["tp"], "shape": [-1]}),
            r"^mesh\.shape\[0\]: expected a positive integer axis size",
        ),
        (_doc(sequence_parallel="on"), r"^sequence_parallel: expected true or false, got str 'on'"),
        (_doc(loss_parallel=1), r"^loss_parallel: expected true or false, got int 1"),
        (_doc(ep_size=0), r"^ep_size: expected a positive integer, got 0"),
        (_doc(modules=[]), r"^modules: expected a mapping of module FQN to its spec, got list"),
        (_doc(modules={1: {}}), r"^modules: keys must be module FQN strings, got int 1"),
        (
            _doc(modules={"a": None}),
            r"^modules\['a'\]: expected a mapping of spec fields \(or \{\}\), got NoneType",
        ),
        (
            _doc(modules={"a": {"in_scr": {}}}),
            r"^modules\['a'\]: unknown key 'in_scr'\. Did you mean 'in_src'\?",
        ),
        (_doc(modules={"a": {1: {}}}), r"^modules\['a'\]: keys must be strings, got int 1"),
        (
            _doc(modules={"a": {"_is_terminal": True}}),
            r"^modules\['a'\]\._is_terminal: internal fields go under the module's "
            r"'_internal:' mapping",
        ),
        (
            _doc(modules={"a": {"in_src": {"x": {"tp": "shard(x)"}}}}),
            r"^modules\['a'\]\.in_src\.x\.tp: 'shard\(x\)' is not a placement\. Grammar: "
            r"replicate \| partial \| shard\(N\)",
        ),
        (
            _doc(modules={"a": {"is_boundary": None}}),
            r"^modules\['a'\]\.is_boundary: expected true or false, got NoneType",
        ),
        (
            _doc(modules={"a": {"skip_source_lowering": "yes"}}),
            r"^modules\['a'\]\.skip_source_lowering: expected true, false or null, got str 'yes'",
        ),
        (
            _doc(modules={"a": {"_internal": []}}),
            r"^modules\['a'\]\._internal: expected a mapping of internal fields",
        ),
        (
            _doc(modules={"a": {"_internal": {"is_termnal": True}}}),
            r"^modules\['a'\]\._internal: unknown key 'is_termnal'\. Did you mean 'is_terminal'\?",
        ),
        (
            _doc(modules={"a": {"_internal": {"_is_terminal": True}}}),
            r"^modules\['a'\]\._internal\._is_terminal: write internal keys without the "
            r"leading underscore",
        ),
        (
            _doc(modules={"a": {"_internal": {"resolved_inner_wrapper": "x"}}}),
            r"^modules\['a'\]\._internal\.resolved_inner_wrapper: runtime introspection "
            r"written by apply\(\)",
        ),
        (
            _doc(modules={"a": {"_internal": {"_resolved_inner_target": "x"}}}),
            r"^modules\['a'\]\._internal\._resolved_inner_target: runtime introspection",
        ),
        (
            _doc(modules={"a": {"_internal": {"tp_local_attr_plan": [1]}}}),
            r"^modules\['a'\]\._internal\.tp_local_attr_plan: expected a mapping of "
            r"attribute name to \[global, local\]",
        ),
        (
            _doc(modules={"a": {"_internal": {"tp_local_attr_plan": {"num_heads": [8]}}}}),
            r"^modules\['a'\]\._internal\.tp_local_attr_plan\.num_heads: expected a pair of "
            r"integers",
        ),
        (
            _doc(modules={"a": {"_internal": {"deferred_bias_params": "o.bias"}}}),
            r"^modules\['a'\]\._internal\.deferred_bias_params: expected a list of parameter paths",
        ),
        (
            _doc(modules={"a": {"_internal": {"deferred_bias_params": [""]}}}),
            r"^modules\['a'\]\._internal\.deferred_bias_params\[0\]: expected a non-empty string",
        ),
        (
            _doc(modules={"a": {"_internal": {"is_terminal": "yes"}}}),
            r"^modules\['a'\]\._internal\.is_terminal: expected true or false",
        ),
        (
            _doc(modules={"a": {"_internal": {"ep_stack": ["w"]}}}),
            r"^modules\['a'\]\._internal\.ep_stack: expected a mapping of stacked path to "
            r"\[source paths\]",
        ),
        (
            _doc(modules={"a": {"_internal": {"ep_stack": {"w": "experts.0.w"}}}}),
            r"^modules\['a'\]\._internal\.ep_stack\.w: expected a list of source parameter paths",
        ),
        (
            _doc(modules={"a": {"_internal": {"ep_stack": {"w": [1]}}}}),
            r"^modules\['a'\]\._internal\.ep_stack\.w\[0\]: expected a non-empty string",
        ),
        (
            _doc(modules={"a": {"_internal": {"ep_size": -1}}}),
            r"^modules\['a'\]\._internal\.ep_size: expected a non-negative integer, got -1",
        ),
    ],
)
def test_document_errors(data, message):
    with pytest.raises(PlanYAMLError, match=message):
        plan_from_dict(data)


def test_null_fields_are_undeclared():
    plan = plan_from_dict(
        _doc(modules={"a": {"params": None, "inner_wrapper": None, "region_dispatch": None}})
    )
    assert plan["a"] == ModuleShardingSpec()


def test_load_plan_text_errors_have_no_file_suffix():
    with pytest.raises(
        PlanYAMLError,
        match=r"^modules: expected a mapping of module FQN to its spec, got list \[\]\.$",
    ):
        load_plan("version: 1\nmesh: {axis_names: [tp]}\nmodules: []\n")


def test_internal_none_values_load_as_defaults():
    data = _doc(
        modules={"a": {"_internal": {"tp_local_attr_plan": None, "deferred_bias_params": None}}}
    )
    spec = plan_from_dict(data)["a"]
    assert spec._tp_local_attr_plan is None and spec._deferred_bias_params == ()


def test_plan_yaml_errors_are_value_errors():
    assert issubclass(PlanYAMLError, PlanError) and issubclass(PlanError, ValueError)
