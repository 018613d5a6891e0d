"""Override lists: loading (YAML and Python forms), dumping, errors, and resolution."""

from __future__ import annotations

import copy
import textwrap
import warnings
from pathlib import Path

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from hp_core.injection import Target, local_compute
from hp_core.plans import (
    WHEN_VALUES,
    IncompleteOverrideError,
    OverrideEntry,
    OverrideError,
    OverrideMatchWarning,
    PlanError,
    PlanYAMLError,
    compile_glob,
    dump_overrides,
    is_glob,
    load_overrides,
    overrides_to_list,
    resolve_overrides,
)
from hp_core.spec import IncompleteContractError, MeshAxisName, ModuleShardingSpec


@local_compute
def my_factory(module, ctx, capacity=1.0):
    return None


# ----------------------------------------------------------------- fixtures

LAYERS = 2


def module_names() -> list[str]:
    names = ["", "model", "model.embed_tokens", "model.layers"]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        names += [p, f"{p}.input_layernorm", f"{p}.self_attn"]
        names += [f"{p}.self_attn.{x}_proj" for x in "qkvo"]
        names += [f"{p}.mlp"] + [f"{p}.mlp.{x}_proj" for x in ("gate", "up", "down")]
    return [*names, "model.norm", "lm_head"]


def derived() -> dict[str, ModuleShardingSpec]:
    out = {
        "model.embed_tokens": ModuleShardingSpec(
            params={"weight": {"tp": Shard(0)}}, in_src={}, in_dst={}
        )
    }
    for i in range(LAYERS):
        attn = ModuleShardingSpec(
            params={f"{x}_proj.weight": {"tp": Shard(0)} for x in "qkv"}
            | {"o_proj.weight": {"tp": Shard(1)}},
            in_src={"hidden_states": {"tp": Shard(1)}},
            in_dst={"hidden_states": {"tp": Replicate()}},
            out_src={"tp": Partial()},
            out_dst={"tp": Shard(1)},
        )
        attn._needs_cp_attn = True
        attn._tp_local_attr_plan = {"num_heads": (8, 4)}
        out[f"model.layers.{i}.self_attn"] = attn
        out[f"model.layers.{i}.mlp"] = ModuleShardingSpec(
            params={"up_proj.weight": {"tp": Shard(0)}, "down_proj.weight": {"tp": Shard(1)}},
            in_src={"x": {"tp": Shard(1)}},
            in_dst={"x": {"tp": Replicate()}},
            out_src={"tp": Partial()},
            out_dst={"tp": Shard(1)},
        )
    out["lm_head"] = ModuleShardingSpec(params={"weight": {"tp": Shard(0)}}, in_src={}, in_dst={})
    return out


def resolve(overrides, *, active=("tp",), mesh=("tp",), derived_specs=None):
    return resolve_overrides(
        derived() if derived_specs is None else derived_specs,
        overrides,
        module_names=module_names(),
        active=set(active),
        mesh_axis_names=mesh,
    )


FULL_INSERT = {
    "params": {},
    "in_src": {"x": {"tp": "replicate"}},
    "in_dst": {"x": {"tp": "replicate"}},
    "out_src": {"tp": "replicate"},
    "out_dst": {"tp": "replicate"},
}


# ------------------------------------------------------------------- loading

YAML_LIST = """
- match: model.layers.*.mlp
  when: tp
  out_dst: {output: {tp: replicate}}
- match: model.layers.0.self_attn
  params: none
  in_src: auto
  tp_divide_attrs: [num_heads]
  inner_target: attn
  inner_wrapper: sdpa_qkv
  region_dispatch: false
  inner_out_src: first_input
- match: lm_head
  local_compute_fn: {_target_: my_factory, capacity: 2.0}
  out_names: [logits]
  is_boundary: false
  inner_out_src: {tp: shard(1)}
"""


def test_load_yaml_list():
    entries = load_overrides(YAML_LIST)
    assert [e.match for e in entries] == [
        "model.layers.*.mlp",
        "model.layers.0.self_attn",
        "lm_head",
    ]
    assert [e.source for e in entries] == ["overrides[0]", "overrides[1]", "overrides[2]"]
    assert entries[0].when == "tp" and entries[1].when is None
    assert entries[0].spec == ModuleShardingSpec(out_dst={"output": {"tp": Replicate()}})
    s1 = entries[1].spec
    assert (s1.params, s1.in_src, s1.tp_divide_attrs) == ("none", "auto", ["num_heads"])
    assert (s1.inner_target, s1.inner_wrapper, s1.region_dispatch, s1.inner_out_src) == (
        "attn",
        "sdpa_qkv",
        False,
        "first_input",
    )
    s2 = entries[2].spec
    assert s2.local_compute_fn == Target("my_factory", {"capacity": 2.0})
    assert s2.out_names == ["logits"] and s2.is_boundary is False
    assert s2.inner_out_src == {"output": {"tp": Shard(1)}}


def test_load_mapping_document_and_empty_documents():
    doc = "overrides:\n" + textwrap.indent(YAML_LIST, "  ")
    assert load_overrides(doc) == load_overrides(YAML_LIST)
    assert load_overrides("") == []
    assert load_overrides("overrides:\n") == []
    assert load_overrides(None) == []
    assert load_overrides([]) == []


def test_load_from_file(tmp_path: Path):
    file = tmp_path / "ov.yaml"
    file.write_text(YAML_LIST, encoding="utf-8")
    assert load_overrides(file) == load_overrides(YAML_LIST)
    assert load_overrides(str(file)) == load_overrides(YAML_LIST)


def test_python_dict_form():
    spec = ModuleShardingSpec(out_dst={"tp": Replicate()})
    entries = load_overrides({"model.layers.*.mlp": spec, "lm_head": ModuleShardingSpec(params={})})
    assert [(e.match, e.source, e.when) for e in entries] == [
        ("model.layers.*.mlp", "overrides['model.layers.*.mlp']", None),
        ("lm_head", "overrides['lm_head']", None),
    ]
    assert entries[0].spec is spec


def test_python_dict_with_overrides_key():
    assert load_overrides({"overrides": [{"match": "lm_head"}]}) == [
        OverrideEntry("lm_head", ModuleShardingSpec())
    ]
    spec = ModuleShardingSpec(params={})
    assert load_overrides({"overrides": spec})[0].match == "overrides"  # a module named 'overrides'


def test_python_list_forms():
    entry = OverrideEntry("lm_head", ModuleShardingSpec(params={}), when=MeshAxisName.TP)
    assert entry.when == "tp" and type(entry.when) is str
    tagged = OverrideEntry("model.norm", ModuleShardingSpec(), source="mine")
    entries = load_overrides(
        [
            entry,
            {
                "match": "model.layers.0.mlp",
                "params": {"up_proj.weight": {MeshAxisName.TP: Shard(0)}},
            },
            {
                "match": "model.layers.1.mlp",
                "local_compute_fn": my_factory,
                "region_dispatch": False,
            },
            {"match": "model.layers.1.self_attn", "inner_wrapper": Target("sdpa_qkv")},
            tagged,
        ]
    )
    assert [e.source for e in entries] == [
        "overrides[0]",
        "overrides[1]",
        "overrides[2]",
        "overrides[3]",
        "mine",
    ]
    assert entries[0] == entry
    assert entries[1].spec.params == {"up_proj.weight": {"tp": Shard(0)}}
    assert entries[2].spec.local_compute_fn is my_factory
    assert entries[3].spec.inner_wrapper == Target("sdpa_qkv")
    assert load_overrides(e for e in [entry]) == [entry]  # any iterable


def test_source_does_not_count_for_equality():
    spec = ModuleShardingSpec()
    assert OverrideEntry("a", spec, source="x") == OverrideEntry("a", spec, source="y")
    assert OverrideEntry("a", spec) != OverrideEntry("a", spec, when="cp")


# ------------------------------------------------------------------- dumping


def test_dump_round_trip_identity():
    entries = load_overrides(YAML_LIST)
    text = dump_overrides(entries)
    assert text.startswith("overrides:\n- match: model.layers.*.mlp\n  when: tp\n")
    again = load_overrides(text)
    assert again == entries
    assert [e.source for e in again] == [e.source for e in entries]
    assert dump_overrides(again) == text
    assert dump_overrides(YAML_LIST) == text  # text in, normalized text out


def test_dump_python_forms():
    text = dump_overrides(
        [
            {
                "match": "model.layers.1.mlp",
                "local_compute_fn": my_factory,
                "params": {"w": {"tp": Shard(0)}},
            },
            OverrideEntry(
                "lm_head", ModuleShardingSpec(in_src="none", is_boundary=False), when="sp"
            ),
        ]
    )
    dotted = f"{my_factory.__module__}.my_factory"
    assert f"local_compute_fn: {{_target_: {dotted}}}" in text
    assert "params:\n    w: {tp: shard(0)}\n" in text
    loaded = load_overrides(text)
    assert loaded[0].spec.local_compute_fn == Target(dotted)
    assert loaded[1] == OverrideEntry(
        "lm_head", ModuleShardingSpec(in_src="none", is_boundary=False), when="sp"
    )
    assert overrides_to_list({"lm_head": ModuleShardingSpec(params={})}) == [
        {"match": "lm_head", "params": {}}
    ]


def test_dump_rejects_unwritable_callables():
    @local_compute
    def nested(module, ctx):
        return None

    with pytest.raises(
        OverrideError,
        match=r"^overrides\['lm_head'\]\.local_compute_fn: .*<locals>\.nested cannot be written",
    ):
        dump_overrides({"lm_head": ModuleShardingSpec(local_compute_fn=nested)})
    with pytest.raises(OverrideError, match="cannot be written as YAML"):
        dump_overrides(
            {"lm_head": ModuleShardingSpec(local_compute_fn=Target("x", {"o": object()}))}
        )


# -------------------------------------------------------------- load errors


def _entry_error(entry, message, index=0):
    items = [{"match": "lm_head"}] * index + [entry]
    with pytest.raises(OverrideError, match=message):
        load_overrides(items)


@pytest.mark.parametrize(
    "entry, message",
    [
        (["match", "lm_head"], r"^overrides\[2\]: expected a mapping with a 'match' key, got list"),
        ({"params": {}}, r"^overrides\[2\]: missing required key 'match' \(the FQN or glob"),
        ({"match": None}, r"^overrides\[2\]: missing required key 'match'"),
        ({"match": 3}, r"^overrides\[2\]\.match: expected a module FQN or glob string, got int 3"),
        (
            {"match": "a", "in_scr": {}},
            r"^overrides\[2\]: unknown key 'in_scr'\. Did you mean 'in_src'\? Valid keys: "
            r"match, when, params",
        ),
        ({"match": "a", "colour": 1}, r"^overrides\[2\]: unknown key 'colour'\. Valid keys: match"),
        ({"match": "a", 5: 1}, r"^overrides\[2\]: keys must be strings, got int 5"),
        (
            {"match": "a", "_is_terminal": True},
            r"^overrides\[2\]\._is_terminal: internal fields \(leading underscore\) are set "
            r"by the planner",
        ),
        (
            {"match": "a", "_internal": {}},
            r"^overrides\[2\]\._internal: internal fields .* an override may set: params, in_src",
        ),
        (
            {"match": "a", "skip_source_lowering": True},
            r"^overrides\[2\]\.skip_source_lowering: set by codegen \(hp freeze\) only",
        ),
        (
            {"match": "a", "when": "xp"},
            r"^overrides\[2\]\.when: 'xp' is not a valid 'when'\.( Did you mean '.p'\?)? "
            r"Valid values: tp, cp, ep, sp",
        ),
        (
            {"match": "a", "when": "TP"},
            r"^overrides\[2\]\.when: 'TP' is not a valid 'when'\. Did you mean 'tp'\?",
        ),
        (
            {"match": "a", "when": 1},
            r"^overrides\[2\]\.when: 1 is not a valid 'when'\. Valid values",
        ),
        (
            {"match": "a", "in_src": {"hidden_states": {"tp": "shard(x)"}}},
            r"^overrides\[2\]\.in_src\.hidden_states\.tp: 'shard\(x\)' is not a placement\. "
            r"Grammar: replicate \| partial \| shard\(N\)",
        ),
        (
            {"match": "a", "in_src": {"x": {}}},
            r"^overrides\[2\]\.in_src\.x: expected a non-empty mapping of mesh axis",
        ),
        (
            {"match": "a", "in_src": {"x": {"": "replicate"}}},
            r"^overrides\[2\]\.in_src\.x: mesh axis names must be non-empty strings",
        ),
        (
            {"match": "a", "params": "all"},
            r"^overrides\[2\]\.params: 'all' is not allowed here; the only string values are "
            r"'auto' .* and 'none'.*params: \{q_proj\.weight",
        ),
        (
            {"match": "a", "params": [1]},
            r"^overrides\[2\]\.params: expected a mapping of name to \{axis: placement\}, got list",
        ),
        (
            {"match": "a", "params": {1: {"tp": "replicate"}}},
            r"^overrides\[2\]\.params: keys must be non-empty strings",
        ),
        (
            {"match": "a", "out_dst": {"tp": "sharded"}},
            r"^overrides\[2\]\.out_dst\.tp: 'sharded' is not a placement",
        ),
        (
            {"match": "a", "out_names": "logits"},
            r"^overrides\[2\]\.out_names: expected a list of names, or 'auto' / 'none', got "
            r"the string 'logits'\. Write a list, e\.g\. \[logits\]",
        ),
        (
            {"match": "a", "out_names": {"a": 1}},
            r"^overrides\[2\]\.out_names: expected a list of names, got dict",
        ),
        (
            {"match": "a", "tp_divide_attrs": ["ok", ""]},
            r"^overrides\[2\]\.tp_divide_attrs\[1\]: expected a non-empty string",
        ),
        (
            {"match": "a", "is_boundary": "no"},
            r"^overrides\[2\]\.is_boundary: expected true or false, got str 'no'",
        ),
        (
            {"match": "a", "region_dispatch": 0},
            r"^overrides\[2\]\.region_dispatch: expected true, false or null, got int 0",
        ),
        (
            {"match": "a", "inner_target": ""},
            r"^overrides\[2\]\.inner_target: expected 'self' or the attribute name of a "
            r"child module",
        ),
        (
            {"match": "a", "inner_wrapper": ""},
            r"^overrides\[2\]\.inner_wrapper: an empty string names no registry item",
        ),
        (
            {"match": "a", "inner_wrapper": 3},
            r"^overrides\[2\]\.inner_wrapper: expected a registry name \(string\), "
            r"\{_target_: \.\.\.\} or a decorated function, got int 3",
        ),
        (
            {"match": "a", "local_compute_fn": {"_taget_": "x"}},
            r"^overrides\[2\]\.local_compute_fn: a mapping here must name what it refers to "
            r"with _target_\. '_taget_' looks like a misspelling",
        ),
        (
            {"match": "a", "local_compute_fn": {"name": "x"}},
            r"^overrides\[2\]\.local_compute_fn: a mapping here must name what it refers to "
            r"with _target_\. Write",
        ),
        (
            {"match": "a", "local_compute_fn": {"_target_": 3}},
            r"^overrides\[2\]\.local_compute_fn: Target: _target_ must be a non-empty "
            r"string, got 3",
        ),
        (
            {"match": "a", "inner_out_src": "last_input"},
            r"^overrides\[2\]\.inner_out_src: 'last_input' is not allowed here; the only "
            r"string values are 'first_input'",
        ),
        (
            {"match": "a", "inner_out_src": "none"},
            r"^overrides\[2\]\.inner_out_src: 'none' is not allowed here",
        ),
    ],
)
def test_entry_errors(entry, message):
    _entry_error(entry, message, index=2)


@pytest.mark.parametrize(
    "doc, message",
    [
        (
            "match: lm_head\nparams: {}\n",
            r"^overrides: the document is a single entry; write entries as a list \(prefix "
            r"the entry with '- '\)",
        ),
        ("overides: []\n", r"^overrides: unknown key 'overides'\. Did you mean 'overrides'\?"),
        (
            "overrides: {match: a}\n",
            r"^overrides: expected a list of entries or \{overrides: \[\.\.\.\]\}, got dict",
        ),
        ("3\n", r"^overrides: expected a list of entries .*, got int 3\. An entry looks like"),
        (
            "my_overrides.txt",
            r"got str 'my_overrides\.txt'\. \(If this was meant as a file path: no such file "
            r"exists\.\)",
        ),
        ("- 1\n", r"^overrides\[0\]: expected a mapping with a 'match' key, got int 1"),
    ],
)
def test_document_errors(doc, message):
    with pytest.raises(OverrideError, match=message):
        load_overrides(doc)


def test_python_form_errors():
    with pytest.raises(
        OverrideError, match=r"^overrides: keys must be module FQN or glob strings, got int 1"
    ):
        load_overrides({1: ModuleShardingSpec()})
    with pytest.raises(
        OverrideError,
        match=r"^overrides\['lm_head'\]: expected a ModuleShardingSpec, got dict .* use a list: "
        r"\[\{'match': 'lm_head', \.\.\.\}\]",
    ):
        load_overrides({"lm_head": {"params": {}}})
    with pytest.raises(
        OverrideError,
        match=r"^overrides: expected YAML text, a file path, \{fqn: ModuleShardingSpec\} or a list "
        r"of entries, got int 3",
    ):
        load_overrides(3)


def test_override_entry_validation():
    spec = ModuleShardingSpec()
    with pytest.raises(
        OverrideError,
        match=r"^OverrideEntry\.match: expected a module FQN or glob string, got NoneType",
    ):
        OverrideEntry(None, spec)
    with pytest.raises(OverrideError, match=r"^x\.match: expected"):
        OverrideEntry(1, spec, source="x")
    with pytest.raises(
        OverrideError, match=r"^OverrideEntry: expected a ModuleShardingSpec, got dict"
    ):
        OverrideEntry("a", {})
    with pytest.raises(OverrideError, match=r"^OverrideEntry\.when: 'dp' is not a valid 'when'"):
        OverrideEntry("a", spec, when="dp")
    with pytest.raises(OverrideError, match=r"^OverrideEntry\.source: expected a string"):
        OverrideEntry("a", spec, source=None)
    with pytest.raises(
        OverrideError, match=r"^OverrideEntry\.skip_source_lowering: set by codegen"
    ):
        OverrideEntry("a", ModuleShardingSpec(skip_source_lowering=True))
    assert WHEN_VALUES == ("tp", "cp", "ep", "sp")


def test_yaml_syntax_errors_name_file_and_line(tmp_path: Path):
    file = tmp_path / "ov.yaml"
    file.write_text("- match: lm_head\n  params: {w: [\n", encoding="utf-8")
    with pytest.raises(PlanYAMLError, match=rf"^{file}:3:1: invalid YAML: "):
        load_overrides(file)
    with pytest.raises(
        PlanYAMLError,
        match=r"^<string>:2:3: invalid YAML: duplicate key 'match' \(first at line 1\)",
    ):
        load_overrides("- match: a\n  match: b\n")
    with pytest.raises(PlanYAMLError, match=r"no such file \(reading overrides\)"):
        load_overrides(tmp_path / "missing.yaml")


def test_errors_from_a_file_name_the_file(tmp_path: Path):
    file = tmp_path / "ov.yaml"
    file.write_text("- match: a\n  in_scr: {}\n", encoding="utf-8")
    with pytest.raises(
        OverrideError, match=rf"^overrides\[0\]: unknown key 'in_scr'.* \(in {file}\)$"
    ):
        load_overrides(file)


def test_error_classes():
    assert issubclass(OverrideError, PlanError) and issubclass(PlanError, ValueError)
    assert issubclass(IncompleteOverrideError, IncompleteContractError)
    assert issubclass(OverrideMatchWarning, UserWarning)


# ---------------------------------------------------------------------- globs


@pytest.mark.parametrize(
    "pattern, name, matches",
    [
        ("model.layers.*.mlp", "model.layers.0.mlp", True),
        ("model.layers.*.mlp", "model.layers.0.block.mlp", True),  # '*' crosses dots
        ("model.layers.*.mlp", "model.layers.0.mlp.up_proj", False),  # anchored at the end
        ("layers.*", "model.layers.0", False),  # anchored at the start
        ("*mlp", "model.layers.1.mlp", True),
        ("**.mlp", "model.layers.1.mlp", True),
        ("model.layers.?.mlp", "model.layers.1.mlp", True),
        ("model.layers.?.mlp", "model.layers.10.mlp", False),
        ("model.layers.[0-1].mlp", "model.layers.1.mlp", True),
        ("model.layers.[0-1].mlp", "model.layers.2.mlp", False),
        ("model.layers.[!0].mlp", "model.layers.0.mlp", False),
        ("model.layers.[!0].mlp", "model.layers.3.mlp", True),
        ("a[]]b", "a]b", True),
        ("a[-x]b", "a-b", True),
        ("a[x-]b", "a-b", True),
        ("a[.]b", "aXb", False),
        ("a[b", "a[b", True),  # no closing bracket: literal
        ("a+b(c)", "a+b(c)", True),
    ],
)
def test_compile_glob(pattern, name, matches):
    assert is_glob(pattern) or pattern == "a+b(c)"
    assert bool(compile_glob(pattern).fullmatch(name)) is matches


def test_compile_glob_rejects_bad_ranges():
    with pytest.raises(
        OverrideError, match=r"^overrides\[0\]\.match: 'a\[z-a\]' is not a valid glob"
    ):
        compile_glob("a[z-a]", path="overrides[0].match")
    assert not is_glob("model.layers.0.mlp")


# ------------------------------------------------------------------ resolution


def test_no_overrides_returns_copies_in_model_order():
    base = derived()
    result, notes = resolve(None, derived_specs=base)
    assert result == base and notes == []
    names = module_names()
    assert list(result) == sorted(base, key=names.index)
    assert all(result[k] is not base[k] for k in base)


def test_exact_key_merges_into_derived_boundary():
    spec = ModuleShardingSpec(
        params={"up_proj.weight": {"tp": Shard(1)}}, out_dst={"tp": Replicate()}
    )
    result, notes = resolve({"model.layers.0.mlp": spec})
    merged = result["model.layers.0.mlp"]
    assert merged.params == {"up_proj.weight": {"tp": Shard(1)}}  # whole field replaced
    assert merged.out_dst == {"output": {"tp": Replicate()}}
    assert merged.in_src == {"x": {"tp": Shard(1)}}  # inherited
    assert result["model.layers.1.mlp"] == derived()["model.layers.1.mlp"]
    assert notes == [
        "overrides['model.layers.0.mlp']: model.layers.0.mlp.params: override replaces the "
        "whole field; dropped keys ['down_proj.weight']"
    ]


def test_internals_come_from_the_derived_spec():
    result, _ = resolve([{"match": "model.layers.0.self_attn", "params": "none"}])
    spec = result["model.layers.0.self_attn"]
    assert (
        spec.params == {}
        and spec._needs_cp_attn
        and spec._tp_local_attr_plan == {"num_heads": (8, 4)}
    )


def test_exact_key_inserts_new_boundary_in_model_order():
    result, notes = resolve([{"match": "model.layers.0.input_layernorm", **FULL_INSERT}])
    assert "model.layers.0.input_layernorm" in result
    names = list(result)
    assert names.index("model.layers.0.input_layernorm") < names.index("model.layers.0.self_attn")
    assert result["model.layers.0.input_layernorm"].params == {}
    assert notes == ["overrides[0]: inserted a new boundary at 'model.layers.0.input_layernorm'"]


def test_second_exact_entry_merges_into_an_inserted_boundary():
    # A second exact entry for one module needs its own 'when' (two unconditional ones are
    # refused, test_error_messages); while its axis is active it merges into the insert.
    entries = [
        {"match": "model.norm", **FULL_INSERT},
        {"match": "model.norm", "when": "tp", "params": {"weight": {"tp": "replicate"}}},
    ]
    result, _ = resolve(entries)
    assert result["model.norm"].params == {"weight": {"tp": Replicate()}}
    assert result["model.norm"].in_src == {"x": {"tp": Replicate()}}
    result, _ = resolve(entries, active=())
    assert result["model.norm"].params == {}


def test_incomplete_insert_is_an_error():
    with pytest.raises(IncompleteOverrideError) as info:
        resolve([{"match": "model.norm", "params": {}}])
    msg = str(info.value)
    assert msg.startswith("overrides[0]: override for 'model.norm' inserts a new boundary")
    assert "missing: in_src, in_dst, out_src, out_dst" in msg
    assert isinstance(info.value, IncompleteContractError)


def test_non_boundary_insert_needs_only_params():
    result, _ = resolve(
        [{"match": "model.norm", "params": {"weight": {"tp": "replicate"}}, "is_boundary": False}]
    )
    assert result["model.norm"].is_boundary is False


def test_exact_key_typo_lists_close_matches():
    with pytest.raises(OverrideError) as info:
        resolve([{"match": "model.layers.0.self_atn", "params": {}}])
    msg = str(info.value)
    assert msg.startswith(
        "overrides[0].match: 'model.layers.0.self_atn' is not a module of the model. Close "
        "matches: 'model.layers.0.self_attn'"
    )
    assert "use a glob (*, ?, [...]) to match several" in msg
    with pytest.raises(
        OverrideError,
        match=r"^overrides\[0\]\.match: 'zzz' is not a module of the model\. No module has a "
        r"similar name\.",
    ):
        resolve([{"match": "zzz"}])


def test_root_module_is_the_empty_string():
    result, _ = resolve([{"match": "", "is_boundary": False, "params": {}}])
    assert next(iter(result)) == ""


def test_glob_merges_into_every_matching_derived_boundary_in_model_order():
    result, notes = resolve([{"match": "*.mlp", "params": {"up_proj.weight": {"tp": "shard(0)"}}}])
    for i in range(LAYERS):
        assert result[f"model.layers.{i}.mlp"].params == {"up_proj.weight": {"tp": Shard(0)}}
    assert "model.layers.0.mlp.up_proj" not in result  # globs never insert
    assert [n.split(": ")[1].split(".params")[0] for n in notes] == [
        "model.layers.0.mlp",
        "model.layers.1.mlp",
    ]


def test_glob_matching_nothing_warns_and_is_noted():
    with pytest.warns(
        OverrideMatchWarning,
        match=r"overrides\[0\]: glob 'model\.blocks\.\*\.mlp' matched no derived boundary; check "
        r"the pattern",
    ):
        result, notes = resolve([{"match": "model.blocks.*.mlp", "params": {}}])
    assert result == derived()
    assert len(notes) == 1 and "matched no derived boundary" in notes[0]


def test_glob_matching_only_non_boundaries_explains_insert():
    with pytest.warns(
        OverrideMatchWarning,
        match=r"it matches 2 module\(s\) \(e\.g\. 'model\.layers\.0\.input_layernorm'\) that are "
        r"not boundaries: insert one with an exact FQN",
    ):
        resolve([{"match": "*.input_layernorm", "params": {}}])


def test_glob_near_miss_suggests_boundaries():
    with pytest.warns(OverrideMatchWarning, match=r"close boundaries: 'model\.layers\.0\.mlp'"):
        resolve([{"match": "model.layers.0.ml?p"}])


def test_when_inactive_is_skipped_active_applies():
    ov = [
        {"match": "lm_head", "when": "cp", "params": "none"},
        {"match": "model.embed_tokens", "when": "sp", "params": "none"},
        {"match": "model.layers.0.mlp", "when": "tp", "out_dst": {"tp": "replicate"}},
    ]
    result, notes = resolve(ov, active={"tp"})
    assert result["lm_head"] == derived()["lm_head"]
    assert result["model.embed_tokens"] == derived()["model.embed_tokens"]
    assert result["model.layers.0.mlp"].out_dst == {"output": {"tp": Replicate()}}
    assert notes[:2] == [
        "overrides[0]: skipped ('lm_head' when: cp; cp is not active)",
        "overrides[1]: skipped ('model.embed_tokens' when: sp; sp is not active)",
    ]
    result, _ = resolve(ov, active={"tp", "cp", "sp"}, mesh=("tp", "cp"))
    assert result["lm_head"].params == {} and result["model.embed_tokens"].params == {}


def test_entries_apply_in_list_order():
    result, _ = resolve(
        [
            {"match": "*.mlp", "out_dst": {"tp": "replicate"}},
            {"match": "model.layers.1.mlp", "out_dst": {"tp": "shard(2)"}},
            {"match": "model.layers.1.mlp", "when": "tp", "in_src": {"y": {"tp": "replicate"}}},
        ]
    )
    assert result["model.layers.0.mlp"].out_dst == {"output": {"tp": Replicate()}}
    assert result["model.layers.1.mlp"].out_dst == {"output": {"tp": Shard(2)}}
    assert result["model.layers.1.mlp"].in_src == {"y": {"tp": Replicate()}}


def test_sentinel_name_lists():
    entries = load_overrides(
        "- match: lm_head\n  out_names: auto\n  tp_divide_attrs: none\n  out_src: null\n"
    )
    assert entries[0].spec == ModuleShardingSpec(out_names="auto", tp_divide_attrs="none")
    result, _ = resolve(entries)
    assert result["lm_head"].tp_divide_attrs == [] and result["lm_head"].out_names is None


def test_sentinels_and_injections_merge():
    result, notes = resolve(
        [
            {
                "match": "model.layers.0.mlp",
                "params": "none",
                "in_src": "auto",
                "local_compute_fn": "qwen2moe",
                "region_dispatch": False,
            },
            {
                "match": "model.layers.0.self_attn",
                "inner_wrapper": {"_target_": "sdpa_qkv"},
                "inner_target": "attn",
                "region_dispatch": False,
            },
        ]
    )
    mlp = result["model.layers.0.mlp"]
    assert (
        mlp.params == {}
        and mlp.in_src == {"x": {"tp": Shard(1)}}
        and mlp.local_compute_fn == "qwen2moe"
    )
    assert result["model.layers.0.self_attn"].inner_wrapper == Target("sdpa_qkv")
    assert any("cleared by 'none'" in n for n in notes)


# ------------------------------------------------------------ validation first


@pytest.mark.parametrize(
    "entry, mesh, message",
    [
        (
            {"match": "lm_head", "in_src": {"hidden_states": {"tpp": "shard(1)"}}},
            ("tp", "cp"),
            r"^overrides\[1\]\.in_src\.hidden_states\.tpp: mesh axis 'tpp' is neither a "
            r"dimension of the mesh \('tp', 'cp'\) nor a canonical axis name\. Did you mean "
            r"'tp'\?",
        ),
        (
            {"match": "lm_head", "params": {"weight": {"encoder_tq": "shard(0)"}}},
            ("encoder_tp",),
            r"^overrides\[1\]\.params\.weight\.encoder_tq: mesh axis 'encoder_tq' .* Did you "
            r"mean 'encoder_tp'\?",
        ),
        (
            {"match": "lm_head", "params": {"weight": {"zz": "shard(0)"}}},
            ("tp",),
            r"^overrides\[1\]\.params\.weight\.zz: mesh axis 'zz' is neither .* canonical "
            r"axis name\. Use one of",
        ),
        (
            {"match": "lm_head", "params": {"weight": {"dp": "shard(0)"}}},
            ("dp", "tp"),
            r"^overrides\[1\]\.params\.weight\.dp: placement on data-parallel axis 'dp'\. dp "
            r"stays outside the plan: FSDP/DDP own it",
        ),
        (
            {"match": "lm_head", "when": "cp", "out_dst": {"dp_shard": "replicate"}},
            ("tp",),
            r"^overrides\[1\]\.out_dst\.output\.dp_shard: placement on data-parallel axis "
            r"'dp_shard'",
        ),
        (
            {"match": "lm_head", "inner_out_src": {"dp_cp": "shard(1)"}},
            ("tp",),
            r"^overrides\[1\]\.inner_out_src\.output\.dp_cp: placement on data-parallel axis",
        ),
        (
            {"match": "lm_haed", "when": "ep"},
            ("tp",),
            r"^overrides\[1\]\.match: 'lm_haed' is not a module of the model\. Close "
            r"matches: 'lm_head'",
        ),
    ],
)
def test_validation_errors(entry, mesh, message):
    base = derived()
    snapshot = copy.deepcopy(base)
    with pytest.raises(OverrideError, match=message):
        resolve([{"match": "*.mlp", "params": "none"}, entry], mesh=mesh, derived_specs=base)
    assert base == snapshot


def test_canonical_axes_off_the_mesh_and_custom_mesh_axes_are_fine():
    result, _ = resolve(
        [
            {
                "match": "lm_head",
                "params": {
                    "weight": {"tp": "shard(0)", "cp": "replicate", "encoder_tp": "replicate"}
                },
            },
        ],
        mesh=("tp", "encoder_tp"),
    )
    assert result["lm_head"].params["weight"]["encoder_tp"] == Replicate()


def test_derived_must_fit_module_names():
    with pytest.raises(PlanError, match=r"derived boundary 'ghost' is not in module_names"):
        resolve(None, derived_specs={"ghost": ModuleShardingSpec()})
    with pytest.raises(
        PlanError, match=r"derived\['lm_head'\]: expected a ModuleShardingSpec, got dict"
    ):
        resolve(None, derived_specs={"lm_head": {}})


# ------------------------------------------------------------ no mutation


def test_inputs_are_never_mutated_and_planning_is_repeatable():
    base = derived()
    base_snapshot = copy.deepcopy(base)
    user_specs = {
        "*.mlp": ModuleShardingSpec(
            out_dst={"tp": Replicate()}, local_compute_fn=Target("moe", {"k": [1]})
        ),
        "model.layers.0.self_attn": ModuleShardingSpec(
            params="none", inner_wrapper="sdpa_qkv", region_dispatch=False
        ),
        "model.norm": ModuleShardingSpec(
            params={}, in_src={}, in_dst={}, out_src="none", out_dst="none"
        ),
    }
    user_snapshot = copy.deepcopy(user_specs)
    first, notes1 = resolve(user_specs, derived_specs=base)
    second, notes2 = resolve(user_specs, derived_specs=base)
    assert first == second and notes1 == notes2
    assert base == base_snapshot
    assert user_specs == user_snapshot
    # the result shares no mutable state with the inputs
    first["model.layers.0.mlp"].local_compute_fn.config["k"].append(2)
    first["model.layers.0.mlp"].out_dst["output"]["tp"] = Shard(0)
    first["model.layers.1.self_attn"].params["q_proj.weight"]["tp"] = Replicate()
    first["model.layers.1.self_attn"]._tp_local_attr_plan["x"] = (1, 1)
    first["model.norm"].params["w"] = {"tp": Replicate()}
    assert base == base_snapshot and user_specs == user_snapshot
    assert second == resolve(user_specs, derived_specs=base)[0]


def test_accepts_yaml_text_and_warns_once_per_glob():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve("- match: '*.nothing'\n- match: '*.mlp'\n  params: none\n")
    assert [type(w.message) for w in caught] == [OverrideMatchWarning]
