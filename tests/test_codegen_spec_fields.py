"""SPEC_FIELDS: the table is docs/artifacts.md's row by row, its views, and the reflection check."""

from __future__ import annotations

import dataclasses

import pytest

from hp_core.artifact.freeze import FREEZERS
from hp_core.artifact.rebuild import REBUILDERS
from hp_core.spec import ModuleShardingSpec
from hp_core.spec import fields as sf
from hp_core.spec.module_spec import table_problems

# docs/artifacts.md's table, copied by hand:
# (field, meta key, group, freeze kind, rebuild kind, post_init).
SPEC_TABLE = [
    ("params", "params", "param_plan", "placement_map", "placement_map", False),
    ("in_src", "in_src", "param_plan", "named_placements", "named_placements", False),
    ("in_dst", "in_dst", "param_plan", "named_placements", "named_placements", False),
    ("out_src", "out_src", "param_plan", "named_placements", "named_placements", False),
    ("out_dst", "out_dst", "param_plan", "named_placements", "named_placements", False),
    ("out_names", "out_names", "param_plan", "name_list", "name_list", False),
    ("tp_divide_attrs", "tp_divide_attrs", "param_plan", "attr_list", "attr_list", False),
    ("is_boundary", "is_boundary", "param_plan", "scalar", "bool_default_true", False),
    ("region_dispatch", "region_dispatch", "param_plan", "scalar", "opt_scalar", False),
    (
        "_deferred_bias_params",
        "deferred_bias_params",
        "param_plan",
        "name_list",
        "tuple_empty",
        True,
    ),
    (
        "skip_source_lowering",
        "skip_source_lowering",
        "param_plan",
        "int_truthy",
        "opt_scalar",
        False,
    ),
    ("inner_wrapper", "inner_wrapper", "injections", "value_to_dict", "injection_target", False),
    ("inner_target", "inner_target", "injections", "plain", "opt_scalar", False),
    ("inner_out_src", "inner_out_src", "injections", "value_to_dict", "injection_target", False),
    (
        "local_compute_fn",
        "local_compute_fn",
        "injections",
        "value_to_dict",
        "injection_target",
        False,
    ),
    ("_ep_stack", "ep_stack", "injections", "dict_copy", "dict_copy", False),
    ("_ep_size", "ep_size", "injections", "int_truthy", "int_truthy", False),
    ("_fused_layouts", "fused_layouts", "injections", "dict_copy", "dict_copy", False),
    ("_tp_local_attr_plan", None, "exempt", None, None, False),
    ("_is_terminal", None, "exempt", None, None, False),
    ("_needs_cp_attn", None, "exempt", None, None, False),
    ("_resolved_inner_wrapper", None, "exempt", None, None, False),
    ("_resolved_inner_target", None, "exempt", None, None, False),
]


def test_table_is_spec_section_8_row_by_row():
    assert [
        (r.name, r.key, r.group, r.freeze, r.rebuild, r.post_init) for r in sf.SPEC_FIELDS
    ] == SPEC_TABLE


def test_write_conditions_are_the_spec_ones():
    assert {k for k, v in sf.WRITE_WHEN.items() if v == "not_none"} == {
        "placement_map",
        "named_placements",
        "attr_list",
        "scalar",
        "value_to_dict",
        "plain",
    }
    assert {k for k, v in sf.WRITE_WHEN.items() if v == "truthy"} == {
        "name_list",
        "dict_copy",
        "int_truthy",
    }


def test_every_kind_has_exactly_one_implementation():
    assert set(FREEZERS) == set(sf.FREEZE_KINDS)
    assert set(REBUILDERS) == set(sf.REBUILD_KINDS)
    assert {r.freeze for r in sf.FROZEN_FIELDS} == set(sf.FREEZE_KINDS)
    assert {r.rebuild for r in sf.FROZEN_FIELDS} == set(sf.REBUILD_KINDS)


def test_derived_views():
    names = lambda rows: [r.name for r in rows]  # noqa: E731
    assert names(sf.PARAM_PLAN_FIELDS) == [r[0] for r in SPEC_TABLE[:11]]
    assert names(sf.INJECTION_FIELDS) == [r[0] for r in SPEC_TABLE[11:18]]
    assert names(sf.EXEMPT_FIELDS) == [r[0] for r in SPEC_TABLE[18:]]
    assert names(sf.FROZEN_FIELDS) == [r[0] for r in SPEC_TABLE[:18]]
    assert names(sf.POST_INIT_FIELDS) == ["_deferred_bias_params"]
    assert sf.FROZEN_META_KEYS == {r[1] for r in SPEC_TABLE if r[1]}
    assert "match" not in sf.FROZEN_META_KEYS
    assert sf.fields_in_group("exempt") == sf.EXEMPT_FIELDS
    assert sf.SPEC_FIELDS_BY_NAME["_ep_size"].key == "ep_size"
    assert sf.FROZEN_GROUPS == ("param_plan", "injections")


def test_unknown_group_names_the_closest():
    with pytest.raises(
        ValueError,
        match=r"unknown SPEC_FIELDS group 'injection'\. Did you mean 'injections'\? Groups: "
        r"param_plan, injections, exempt\.",
    ):
        sf.fields_in_group("injection")
    with pytest.raises(ValueError, match=r"unknown SPEC_FIELDS group 'zzz'\. Groups:"):
        sf.fields_in_group("zzz")


def test_should_write_follows_the_freeze_kind():
    row = sf.SPEC_FIELDS_BY_NAME
    assert row["params"].should_write({}) and not row["params"].should_write(None)
    assert row["tp_divide_attrs"].should_write([])
    assert row["is_boundary"].should_write(False)
    assert not row["out_names"].should_write([]) and row["out_names"].should_write(["a"])
    assert not row["_ep_stack"].should_write({}) and not row["_ep_size"].should_write(0)
    assert not row["skip_source_lowering"].should_write(False)
    assert not row["_is_terminal"].should_write(True)  # exempt rows are never written


def test_the_table_classifies_the_dataclass_exactly():
    assert table_problems() == []


def test_reflection_catches_a_new_field_without_a_row():
    @dataclasses.dataclass
    class Grown(ModuleShardingSpec):
        new_knob: int = 0

    assert table_problems(Grown) == [
        "Grown.new_knob has no row in SPEC_FIELDS: classify it (a frozen group with its meta key "
        "and kinds, or exempt) in hp_core/spec/fields.py"
    ]


def test_reflection_catches_a_row_without_a_field_and_a_bad_post_init():
    rows = [*sf.SPEC_FIELDS, sf.SpecField("ghost", "ghost", "param_plan", "scalar", "opt_scalar")]
    assert table_problems(rows=rows) == [
        "SPEC_FIELDS row 'ghost' names no field of ModuleShardingSpec: remove the row or fix "
        "its name"
    ]
    rows = [
        dataclasses.replace(r, post_init=True) if r.name == "params" else r for r in sf.SPEC_FIELDS
    ]
    assert table_problems(rows=rows) == [
        "SPEC_FIELDS row 'params' is post_init but ModuleShardingSpec.params is a "
        "constructor argument"
    ]


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ("x", "x", "nope", "scalar", "opt_scalar"),
            r"SpecField\('x'\): unknown group 'nope'; groups are param_plan, injections, exempt\.",
        ),
        (
            ("x", "x", "exempt", None, None),
            r"SpecField\('x'\): an exempt field is not frozen, so it has no meta key, kinds "
            r"or post_init\.",
        ),
        (("x", None, "exempt", None, None, True), r"an exempt field is not frozen"),
        (
            ("x", None, "param_plan", "scalar", "opt_scalar"),
            r"SpecField\('x'\): a frozen field needs a meta key other than 'match', got None\.",
        ),
        (
            ("x", "match", "param_plan", "scalar", "opt_scalar"),
            r"needs a meta key other than 'match', got 'match'\.",
        ),
        (
            ("x", "x", "param_plan", "yaml", "opt_scalar"),
            r"SpecField\('x'\): unknown freeze kind 'yaml'; kinds are placement_map, ",
        ),
        (
            ("x", "x", "param_plan", "scalar", "yaml"),
            r"SpecField\('x'\): unknown rebuild kind 'yaml'; kinds are placement_map, ",
        ),
    ],
)
def test_a_malformed_row_is_refused(args, message):
    with pytest.raises(ValueError, match=message):
        sf.SpecField(*args)


def test_duplicate_fields_or_meta_keys_are_refused():
    row = sf.SPEC_FIELDS[0]
    with pytest.raises(ValueError, match=r"SPEC_FIELDS: field 'params' has more than one row\."):
        sf._check_unique([row, row])
    with pytest.raises(
        ValueError, match=r"SPEC_FIELDS: meta key 'params' is used by more than one row\."
    ):
        sf._check_unique([row, dataclasses.replace(row, name="other")])


@pytest.mark.parametrize(
    "options,message",
    [
        ({"source": "nope"}, r"SpecField\('x'\): unknown source 'nope' or merge None\."),
        ({"merge": "nope"}, r"SpecField\('x'\): unknown source 'user' or merge 'nope'\."),
        ({"kind": "nope"}, r"SpecField\('x'\): unknown kind 'nope'; kinds are "),
    ],
)
def test_a_row_with_an_unknown_source_merge_or_kind_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        sf.SpecField("x", "x", "param_plan", "scalar", "opt_scalar", **options)
