"""The spec model: axes, the placement DSL, ModuleShardingSpec and the merge rule."""

from __future__ import annotations

import copy
import pickle

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from hp_core import spec as S
from hp_core.injection import Target, inner_wrapper
from hp_core.spec import (
    AUTO,
    NONE,
    IncompleteContractError,
    MeshAxisName,
    ModuleShardingSpec,
    PlacementMismatchError,
    PlacementSyntaxError,
    SpecValidationError,
    finalize_insert,
    format_named_placement,
    format_placement,
    merge_specs,
    parse_named_placement,
    parse_placement,
    resolve_placements,
)
from hp_core.spec.derived import Derived
from hp_core.spec.module_spec import copy_value, layout_map

# ------------------------------------------------------------------ axes


def test_axis_names_equal_and_hash_like_plain_strings():
    assert MeshAxisName.tp == "tp"
    assert hash(MeshAxisName.ep_shard) == hash("ep_shard")
    assert {"tp": 1}[MeshAxisName.tp] == 1
    assert str(MeshAxisName.dp_cp) == "dp_cp"
    assert f"{MeshAxisName.cp:>4}" == "  cp"
    assert [m.value for m in MeshAxisName] == [
        "tp",
        "cp",
        "ep",
        "pp",
        "dp",
        "dp_replicate",
        "dp_shard",
        "dp_cp",
        "ep_shard",
    ]


def test_axis_aliases():
    assert MeshAxisName.TP is MeshAxisName.tp
    assert MeshAxisName.DP is MeshAxisName.dp
    assert (S.TP, S.CP, S.EP, S.DP) == ("tp", "cp", "ep", "dp")
    assert "ep_shard" in S.CANONICAL_AXES and "encoder_dp" not in S.CANONICAL_AXES


def test_resolve_placements_mesh_order_missing_replicated():
    got = resolve_placements({"tp": Shard(1), MeshAxisName.cp: Shard(0)}, ("dp", "cp", "tp"))
    assert got == [Replicate(), Shard(0), Shard(1)]
    assert resolve_placements({}, ["tp"]) == [Replicate()]


def test_resolve_placements_unknown_axis_names_closest():
    with pytest.raises(
        ValueError, match=r"'tpp' is not a dimension of the mesh \('dp', 'tp'\).*Did you mean 'tp'"
    ):
        resolve_placements({"tpp": Shard(0)}, ["dp", "tp"])
    with pytest.raises(ValueError) as e:
        resolve_placements({"zzz": Shard(0)}, ["tp"])
    assert "Did you mean" not in str(e.value)


# ------------------------------------------------------------------ DSL


@pytest.mark.parametrize(
    "text,expected",
    [
        ("Shard( 2 )", Shard(2)),
        ("shard(0)", Shard(0)),
        ("  SHARD(10)  ", Shard(10)),
        ("replicate", Replicate()),
        (" Replicate ", Replicate()),
        ("PARTIAL", Partial()),
    ],
)
def test_parse_placement_grammar(text, expected):
    assert parse_placement(text) == expected


def test_parse_placement_passes_placement_objects_through():
    p = Shard(3)
    assert parse_placement(p) is p


@pytest.mark.parametrize(
    "text",
    [
        "shard(-1)",
        "shard()",
        "shard(1.5)",
        "sharded(1)",
        "",
        "replicate(0)",
        "partial(avg)",
        "shard(1) x",
    ],
)
def test_parse_placement_rejects_with_grammar(text):
    with pytest.raises(PlacementSyntaxError) as e:
        parse_placement(text, path="overrides[0].in_src.x.tp")
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert msg.startswith("overrides[0].in_src.x.tp: ")
    assert repr(text) in msg
    assert "replicate | partial | shard(N)" in msg


def test_parse_placement_rejects_non_string():
    with pytest.raises(
        PlacementSyntaxError, match=r"p: expected a placement string, got int 3\..*Grammar"
    ):
        parse_placement(3, path="p")


def test_format_placement_is_inverse():
    for p in (Shard(0), Shard(7), Replicate(), Partial()):
        assert parse_placement(format_placement(p)) == p
    assert format_placement(Shard(2)) == "shard(2)"


def test_format_placement_without_dsl_form():
    with pytest.raises(PlacementSyntaxError, match="has no DSL form"):
        format_placement(Partial("avg"))


def test_named_placement_round_trip_and_custom_axes():
    named = parse_named_placement({"tp": "shard(1)", " encoder_dp ": "replicate"}, path="x")
    assert named == {"tp": Shard(1), "encoder_dp": Replicate()}
    assert format_named_placement(named) == {"tp": "shard(1)", "encoder_dp": "replicate"}
    assert parse_named_placement(format_named_placement(named)) == named


@pytest.mark.parametrize("raw", [{}, None, "shard(1)", ["tp"]])
def test_named_placement_must_be_nonempty_mapping(raw):
    with pytest.raises(PlacementSyntaxError, match=r"^doc\.a: expected a non-empty mapping"):
        parse_named_placement(raw, path="doc.a")


@pytest.mark.parametrize("axis", ["", "  ", 3])
def test_named_placement_axis_must_be_nonempty_string(axis):
    with pytest.raises(
        PlacementSyntaxError, match=r"doc: mesh axis names must be non-empty strings"
    ):
        parse_named_placement({axis: "replicate"}, path="doc")


def test_named_placement_error_carries_nested_path():
    with pytest.raises(PlacementSyntaxError, match=r"^doc\.tp: 'shard\(x\)' is not a placement"):
        parse_named_placement({"tp": "shard(x)"}, path="doc")


# ------------------------------------------------------------------ ModuleShardingSpec


def test_spec_defaults_and_internal_fields():
    s = ModuleShardingSpec()
    assert s.params is None and s.in_src is None and s.is_boundary is True
    assert s._deferred_bias_params == () and s._ep_stack == {} and s._ep_size == 0
    assert s._is_terminal is False and s._needs_cp_attn is False
    assert (
        s._tp_local_attr_plan is None
        and s._resolved_inner_wrapper is None
        and s._resolved_inner_target is None
    )
    assert not s.has_injection and s.output_names() == []
    with pytest.raises(TypeError):
        ModuleShardingSpec(_ep_size=2)  # internal: not an init argument


def test_out_shorthand_normalizes_and_is_idempotent():
    s = ModuleShardingSpec(out_src={"tp": Shard(1)}, out_dst={MeshAxisName.tp: "replicate"})
    assert s.out_src == {"output": {"tp": Shard(1)}}
    assert s.out_dst == {"output": {"tp": Replicate()}}
    assert type(next(iter(s.out_dst["output"]))) is str  # enum keys become plain strings
    again = ModuleShardingSpec(out_src=s.out_src)
    assert again.out_src == s.out_src
    assert s.output_names() == ["output"]


def test_named_outputs_and_out_names():
    s = ModuleShardingSpec(
        out_src={"a": {"tp": Shard(0)}, "b": {"tp": Replicate()}}, out_names=["b", "a"]
    )
    assert s.output_names() == ["b", "a"]
    assert ModuleShardingSpec(
        out_src={"a": {"tp": Shard(0)}, "b": {"tp": Replicate()}}
    ).output_names() == ["a", "b"]


def test_dsl_strings_accepted_in_python_specs():
    s = ModuleShardingSpec(params={"weight": {"tp": "shard(0)"}}, in_src={"x": {"tp": "Replicate"}})
    assert s.params == {"weight": {"tp": Shard(0)}}
    assert s.in_src == {"x": {"tp": Replicate()}}


def test_spec_copies_user_dicts():
    params = {"weight": {"tp": Shard(0)}}
    s = ModuleShardingSpec(params=params)
    params["weight"]["tp"] = Replicate()
    assert s.params == {"weight": {"tp": Shard(0)}}


def test_sentinels_are_kept():
    s = ModuleShardingSpec(params=AUTO, in_src=NONE, out_names="auto", tp_divide_attrs="none")
    assert (s.params, s.in_src, s.out_names, s.tp_divide_attrs) == ("auto", "none", "auto", "none")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(params="all"),
            r"ModuleShardingSpec\.params: the only string values are the sentinels",
        ),
        (dict(params=[1]), r"ModuleShardingSpec\.params: expected a mapping"),
        (
            dict(params={"": {"tp": Shard(0)}}),
            r"ModuleShardingSpec\.params: keys must be non-empty",
        ),
        (
            dict(params={"w": {}}),
            r"ModuleShardingSpec\.params\.w: expected a non-empty \{axis: placement\}",
        ),
        (dict(params={"w": {"": Shard(0)}}), r"params\.w: mesh axis names must be non-empty"),
        (
            dict(params={"w": {"tp": "shard(-2)"}}),
            r"params\.w\.tp: 'shard\(-2\)' is not a placement",
        ),
        (dict(in_dst={"x": {"tp": 5}}), r"in_dst\.x\.tp: expected a placement string"),
        (dict(out_src=["a"]), r"out_src: expected a mapping"),
        (dict(out_names="abc"), r"out_names: the only string values"),
        (dict(out_names=5), r"out_names: expected a list of names"),
        (
            dict(tp_divide_attrs=["num_heads", ""]),
            r"tp_divide_attrs: every entry must be a non-empty string",
        ),
        (dict(is_boundary="yes"), r"is_boundary: expected True or False"),
        (dict(region_dispatch=1), r"region_dispatch: expected True, False or None"),
        (dict(skip_source_lowering="x"), r"skip_source_lowering: expected True, False or None"),
        (dict(inner_target=""), r"inner_target: expected 'self' or a child attribute name"),
        (dict(inner_wrapper=""), r"inner_wrapper: an empty string names no registry item"),
        (
            dict(local_compute_fn=3),
            r"local_compute_fn: expected a registry name, a decorated function or a Target",
        ),
        (
            dict(inner_out_src="last_input"),
            r"inner_out_src: the only string value is 'first_input'",
        ),
        (dict(inner_out_src={"tp": "bogus"}), r"inner_out_src\.tp: 'bogus' is not a placement"),
    ],
)
def test_spec_field_validation(kwargs, match):
    with pytest.raises(SpecValidationError, match=match):
        ModuleShardingSpec(**kwargs)


def test_injection_field_forms():
    @inner_wrapper
    def w(target_module, ctx):
        return None

    t = Target("qwen2moe", {"capacity": 2})
    s = ModuleShardingSpec(
        inner_target="self", inner_wrapper=w, local_compute_fn=t, inner_out_src="first_input"
    )
    assert s.has_injection and s.inner_wrapper is w and s.local_compute_fn is t
    s2 = ModuleShardingSpec(
        inner_target="core", inner_wrapper="sdpa_qkv", inner_out_src={"tp": Replicate()}
    )
    assert s2.inner_out_src == {"output": {"tp": Replicate()}}


# ------------------------------------------------------------------ merge


def _derived() -> ModuleShardingSpec:
    d = ModuleShardingSpec(
        params={"q_proj.weight": {"tp": Shard(0)}, "o_proj.weight": {"tp": Shard(1)}},
        in_src={"hidden_states": {"tp": Shard(1)}},
        in_dst={"hidden_states": {"tp": Replicate()}},
        out_src={"tp": Partial()},
        out_dst={"tp": Shard(1)},
        tp_divide_attrs=["num_heads"],
    )
    d._deferred_bias_params = ("o_proj.bias",)
    d._needs_cp_attn = True
    d._ep_stack = {"experts.w": ["experts.0.w"]}
    d._ep_size = 2
    d._tp_local_attr_plan = {"num_heads": (8, 4)}
    return d


def test_merge_unset_and_auto_inherit_internal_from_derived():
    derived = _derived()
    merged, notes = merge_specs(derived, ModuleShardingSpec(in_dst=AUTO), fqn="m")
    for name in S.CONTRACT_FIELDS:
        assert getattr(merged, name) == getattr(derived, name)
    assert merged._deferred_bias_params == ("o_proj.bias",)
    assert merged._needs_cp_attn and merged._ep_size == 2 and merged._ep_stack == derived._ep_stack
    assert merged._tp_local_attr_plan == {"num_heads": (8, 4)}
    assert notes == []
    merged._ep_stack["x"] = []
    merged.params["q_proj.weight"]["tp"] = Replicate()
    assert derived._ep_stack == {"experts.w": ["experts.0.w"]}  # deep enough copy
    assert derived.params["q_proj.weight"]["tp"] == Shard(0)


def test_merge_explicit_value_replaces_whole_field_and_notes_dropped_keys():
    derived = _derived()
    merged, notes = merge_specs(
        derived,
        ModuleShardingSpec(params={"q_proj.weight": {"tp": Replicate()}}),
        fqn="layers.0.attn",
    )
    assert merged.params == {"q_proj.weight": {"tp": Replicate()}}
    assert notes == [
        "layers.0.attn.params: override replaces the whole field; dropped keys ['o_proj.weight']"
    ]


def test_merge_explicit_empty_dict_replaces():
    merged, notes = merge_specs(_derived(), ModuleShardingSpec(params={}), fqn="m")
    assert merged.params == {}
    assert "dropped keys ['q_proj.weight', 'o_proj.weight']" in notes[0]


def test_merge_none_sentinel_clears():
    merged, notes = merge_specs(
        _derived(),
        ModuleShardingSpec(
            params=NONE, in_src=NONE, out_src=NONE, out_names=NONE, tp_divide_attrs=NONE
        ),
        fqn="m",
    )
    assert merged.params == {} and merged.in_src == {}
    assert merged.out_src is None and merged.out_names is None
    assert merged.tp_divide_attrs == []
    assert any(n.startswith("m.params: cleared by 'none'") for n in notes)
    assert not any(n.startswith("m.out_names") for n in notes)  # nothing derived to drop


def test_merge_list_fields_note_replacement():
    merged, notes = merge_specs(
        _derived(), ModuleShardingSpec(tp_divide_attrs=["num_kv_heads"]), fqn="m"
    )
    assert merged.tp_divide_attrs == ["num_kv_heads"]
    assert notes == ["m.tp_divide_attrs: override replaces ['num_heads'] with ['num_kv_heads']"]
    _, quiet = merge_specs(_derived(), ModuleShardingSpec(tp_divide_attrs=["num_heads"]), fqn="m")
    assert quiet == []
    cleared, _ = merge_specs(_derived(), ModuleShardingSpec(tp_divide_attrs=[]), fqn="m")
    assert cleared.tp_divide_attrs == []


def test_merge_injection_fields_win_when_set():
    derived = _derived()
    derived.inner_target = "self"
    derived.region_dispatch = True
    merged, _ = merge_specs(
        derived, ModuleShardingSpec(inner_wrapper="sdpa_hf", region_dispatch=False), fqn="m"
    )
    assert merged.inner_wrapper == "sdpa_hf" and merged.region_dispatch is False
    assert merged.inner_target == "self"  # inherited: override left it None


def test_merge_is_boundary_false_wins_true_inherits():
    d = _derived()
    assert merge_specs(d, ModuleShardingSpec(is_boundary=False))[0].is_boundary is False
    d.is_boundary = False
    assert merge_specs(d, ModuleShardingSpec())[0].is_boundary is False


def test_merge_never_mutates_inputs_and_is_deterministic():
    derived, override = (
        _derived(),
        ModuleShardingSpec(in_dst={"hidden_states": {"tp": Shard(1)}}, inner_wrapper="x"),
    )
    before = (copy.deepcopy(derived), copy.deepcopy(override))
    a, _ = merge_specs(derived, override)
    b, _ = merge_specs(derived, override)
    assert a == b
    assert (derived, override) == before


def test_merge_derived_sentinel_is_not_propagated():
    weird = ModuleShardingSpec(out_names=AUTO)
    merged, _ = merge_specs(weird, ModuleShardingSpec())
    assert merged.out_names is None


def test_finalize_insert_complete_contract():
    ins = finalize_insert(
        ModuleShardingSpec(
            params=NONE,
            in_src=NONE,
            in_dst=NONE,
            out_src={"tp": Replicate()},
            out_dst={"tp": Replicate()},
        ),
        fqn="model.extra",
    )
    assert ins.params == {} and ins.in_src == {} and ins.in_dst == {}
    assert ins.out_dst == {"output": {"tp": Replicate()}}


def test_finalize_insert_non_boundary_needs_params_only():
    ins = finalize_insert(
        ModuleShardingSpec(params={"weight": {"tp": Shard(0)}}, is_boundary=False), fqn="m.w"
    )
    assert ins.params == {"weight": {"tp": Shard(0)}} and ins.in_src == {} and ins.in_dst == {}
    assert ins.is_boundary is False


def test_finalize_insert_incomplete_names_fqn_missing_fields_and_fix():
    with pytest.raises(IncompleteContractError) as e:
        finalize_insert(ModuleShardingSpec(params={}, in_src=AUTO), fqn="model.layers.0.extra")
    msg = str(e.value)
    assert msg.startswith("override for 'model.layers.0.extra' inserts a new boundary")
    assert "missing: in_src, in_dst, out_src, out_dst" in msg
    assert "- match: 'model.layers.0.extra'" in msg and "in_src: {x: {tp: replicate}}" in msg
    with pytest.raises(IncompleteContractError, match=r"missing: params\."):
        finalize_insert(ModuleShardingSpec(is_boundary=False), fqn="m")


# ------------------------------------------------------------------ errors


def test_placement_mismatch_error_message_and_fields():
    e = PlacementMismatchError(
        "model.layers.0.mlp", {"tp": Shard(1)}, {"tp": Partial()}, "out_src[output]"
    )
    assert isinstance(e, ValueError)
    assert (e.module_name, e.stage) == ("model.layers.0.mlp", "out_src[output]")
    msg = str(e)
    assert msg.startswith("model.layers.0.mlp: out_src[output] placement mismatch.")
    assert "expected (plan): {tp: shard(1)}" in msg
    assert "actual (DTensor propagation): {tp: partial}" in msg
    assert "(out_src: ...)" in msg


def test_placement_mismatch_error_formats_any_value_and_pickles():
    e = PlacementMismatchError("m", [Shard(0), Partial("avg")], "n/a", "params")
    assert "expected (plan): [shard(0), Partial(avg)]" in str(e)
    assert "actual (DTensor propagation): n/a" in str(e)
    e2 = pickle.loads(pickle.dumps(e))
    assert str(e2) == str(e) and e2.stage == "params"


def test_placement_mismatch_error_rejects_unknown_stage():
    with pytest.raises(ValueError, match="unknown PlacementMismatchError stage 'forward'"):
        PlacementMismatchError("m", {}, {}, "forward")
    for stage in ("params", "out_src", "out_src[x]", "out_dst", "inner_out_src"):
        assert PlacementMismatchError("m", {}, {}, stage).stage == stage


def test_close_matches():
    assert S.close_matches("tpp", ["tp", "cp", "ep"])[0] == "tp"
    assert S.close_matches("qqqq", ["tp"]) == []


def test_merge_copies_targets():
    from hp_core.injection import Target

    t = Target("qwen2moe", {"capacity": 1})
    merged, _ = merge_specs(
        ModuleShardingSpec(), ModuleShardingSpec(local_compute_fn=t, region_dispatch=False)
    )
    assert merged.local_compute_fn == t and merged.local_compute_fn is not t
    merged.local_compute_fn.config["capacity"] = 9
    assert t.config == {"capacity": 1}


def test_layout_map_reads_a_planned_field_and_refuses_a_sentinel():
    layouts = {"x": {"tp": Shard(0)}}
    assert layout_map(layouts) is layouts and layout_map(None) == {} and layout_map({}) == {}
    with pytest.raises(S.SpecValidationError, match=r"holds the sentinel 'auto', which only an"):
        layout_map("auto")


def test_copy_value_copies_a_derived_record():
    record = Derived(ep_stack={"experts.w": ["experts.0.w", "experts.1.w"]}, ep_size=2)
    dup = copy_value(record)
    assert dup == record and dup is not record and dup.ep_stack is not record.ep_stack
    dup.ep_stack["experts.w"].append("x")
    assert record.ep_stack["experts.w"] == ["experts.0.w", "experts.1.w"]


def test_copy_value_copies_inside_tuples():
    inner = ["b"]
    dup = copy_value(("a", inner))
    assert dup == ("a", ["b"]) and isinstance(dup, tuple) and dup[1] is not inner


def test_derived_facts_are_written_by_name_and_an_unknown_one_is_refused():
    spec = ModuleShardingSpec()
    before = spec.derived
    assert spec.with_derived(ep_size=2, is_terminal=True) is spec
    assert (spec._ep_size, spec._is_terminal, before.ep_size) == (2, True, 0)
    with pytest.raises(TypeError, match=r"^Derived has no field 'nope'; its fields are deferred_"):
        spec.with_derived(nope=1)
