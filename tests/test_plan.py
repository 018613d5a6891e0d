"""ShardingPlan: construction, mapping helpers, fingerprint and copy."""

from __future__ import annotations

import re

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from hp_core.injection import Target, local_compute
from hp_core.plans import OVERRIDE_FIELDS, USER_FIELDS, PlanError, ShardingPlan, copy_spec
from hp_core.plans.spec_codec import INTERNAL_FIELDS as _INTERNAL_FIELDS
from hp_core.spec import MeshAxisName, ModuleShardingSpec
from hp_core.spec.fields import RUNTIME_FIELDS as _RUNTIME_FIELDS
from hp_core.spec.module_spec import spec_field_names


def attn_spec() -> ModuleShardingSpec:
    spec = ModuleShardingSpec(
        params={"q_proj.weight": {"tp": Shard(0)}, "o_proj.weight": {"tp": Shard(1)}},
        in_src={"hidden_states": {"tp": Shard(1)}},
        in_dst={"hidden_states": {"tp": Replicate()}},
        out_src={"tp": Partial()},
        out_dst={"tp": Shard(1)},
        inner_target="attn",
        inner_wrapper=Target("sdpa_qkv", {"block": 64}),
        region_dispatch=False,
        inner_out_src="first_input",
    )
    spec._tp_local_attr_plan = {"num_heads": (8, 2)}
    spec._deferred_bias_params = ("o_proj.bias",)
    spec._needs_cp_attn = True
    return spec


def make_plan(**kw) -> ShardingPlan:
    modules = {
        "model.embed_tokens": ModuleShardingSpec(
            params={"weight": {"tp": Shard(0)}}, is_boundary=False
        ),
        "model.layers.0.self_attn": attn_spec(),
        "lm_head": ModuleShardingSpec(params={}, in_src={}, in_dst={}),
    }
    modules["lm_head"]._is_terminal = True
    defaults = dict(
        modules=modules, mesh_axis_names=("tp", "cp"), mesh_shape=(2, 2), sequence_parallel=True
    )
    defaults.update(kw)
    return ShardingPlan(**defaults)


# ----------------------------------------------------------------- structure


def test_every_spec_field_is_classified():
    """A new ModuleShardingSpec field must be added to plan.py's tables (and its YAML form)."""
    classified = set(USER_FIELDS) | set(_INTERNAL_FIELDS.values()) | set(_RUNTIME_FIELDS)
    fields = spec_field_names(ModuleShardingSpec)
    assert set(fields) == classified
    assert [n for n in fields if n in USER_FIELDS] == list(
        USER_FIELDS
    )  # dump order = dataclass order
    assert "skip_source_lowering" not in OVERRIDE_FIELDS


def test_mapping_helpers_keep_model_order():
    plan = make_plan()
    assert list(plan) == ["model.embed_tokens", "model.layers.0.self_attn", "lm_head"]
    assert [k for k, _ in plan.items()] == list(plan)
    assert len(plan) == 3
    assert "lm_head" in plan and "model" not in plan
    assert plan["lm_head"] is plan.modules["lm_head"]
    assert list(plan.boundaries()) == ["model.layers.0.self_attn", "lm_head"]


def test_getitem_unknown_suggests_closest():
    with pytest.raises(KeyError, match=r"'lm_haed' is not in the plan\. Did you mean 'lm_head'\?"):
        make_plan()["lm_haed"]


def test_defaults_and_normalization():
    plan = ShardingPlan({}, [MeshAxisName.TP, "cp"], [4, 2])
    assert plan.mesh_axis_names == ("tp", "cp")
    assert all(type(n) is str for n in plan.mesh_axis_names)
    assert plan.mesh_shape == (4, 2)
    assert (plan.sequence_parallel, plan.loss_parallel, plan.ep_size, plan.notes) == (
        False,
        False,
        1,
        [],
    )
    src = {"a": ModuleShardingSpec()}
    assert ShardingPlan(src, ("tp",)).modules is not src


def test_notes_do_not_count_for_equality():
    assert make_plan(notes=["x dropped"]) == make_plan()
    assert make_plan() != make_plan(loss_parallel=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(modules=[1]), r"ShardingPlan\.modules: expected a dict of module FQN"),
        (
            dict(modules={1: ModuleShardingSpec()}),
            r"ShardingPlan\.modules: keys must be module FQN strings, got 1",
        ),
        (
            dict(modules={"a": {}}),
            r"ShardingPlan\.modules\['a'\]: expected a ModuleShardingSpec, got dict",
        ),
        (
            dict(mesh_axis_names="tp"),
            r"ShardingPlan\.mesh_axis_names: expected a list of mesh axis names",
        ),
        (
            dict(mesh_axis_names=("tp", "")),
            r"ShardingPlan\.mesh_axis_names\[1\]: expected a non-empty axis name",
        ),
        (
            dict(mesh_axis_names=("tp", "tp"), mesh_shape=None),
            r"axis names must be unique, \['tp'\] appear",
        ),
        (
            dict(mesh_shape=(2,)),
            r"ShardingPlan\.mesh_shape: 1 size\(s\) \[2\] for 2 axis name\(s\)",
        ),
        (
            dict(mesh_shape=(2, 0)),
            r"ShardingPlan\.mesh_shape\[1\]: expected a positive integer axis size, got 0",
        ),
        (dict(mesh_shape=(2, True)), r"ShardingPlan\.mesh_shape\[1\]: expected a positive integer"),
        (
            dict(mesh_shape="2x2"),
            r"ShardingPlan\.mesh_shape: expected a list of positive axis sizes",
        ),
        (
            dict(sequence_parallel="yes"),
            r"ShardingPlan\.sequence_parallel: expected true or false, got str",
        ),
        (dict(loss_parallel=None), r"ShardingPlan\.loss_parallel: expected true or false"),
        (dict(ep_size=0), r"ShardingPlan\.ep_size: expected a positive integer, got 0"),
        (dict(ep_size=True), r"ShardingPlan\.ep_size: expected a positive integer, got True"),
        (dict(notes="oops"), r"ShardingPlan\.notes: expected a list of strings"),
        (dict(notes=[1]), r"ShardingPlan\.notes: expected a list of strings"),
    ],
)
def test_invalid_plan_fields(kwargs, message):
    with pytest.raises(PlanError, match=message):
        make_plan(**kwargs)


# --------------------------------------------------------------- fingerprint


def test_fingerprint_is_stable_sha256():
    fp = make_plan().fingerprint()
    assert re.fullmatch(r"[0-9a-f]{64}", fp)
    assert make_plan().fingerprint() == fp
    assert make_plan().copy().fingerprint() == fp


def test_fingerprint_ignores_notes_and_runtime_fields():
    plan = make_plan()
    fp = plan.fingerprint()
    plan.notes.append("dropped")
    plan["model.layers.0.self_attn"]._resolved_inner_wrapper = object()
    plan["model.layers.0.self_attn"]._resolved_inner_target = "attn"
    assert plan.fingerprint() == fp


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p: p.modules["model.layers.0.self_attn"].params.__setitem__(
            "k_proj.weight", {"tp": Shard(0)}
        ),
        lambda p: p.modules["model.layers.0.self_attn"].out_dst.__setitem__(
            "output", {"tp": Replicate()}
        ),
        lambda p: setattr(p.modules["lm_head"], "in_src", None),
        lambda p: setattr(p.modules["lm_head"], "is_boundary", False),
        lambda p: setattr(p.modules["lm_head"], "skip_source_lowering", True),
        lambda p: setattr(p.modules["lm_head"], "tp_divide_attrs", []),
        lambda p: setattr(p.modules["lm_head"], "local_compute_fn", "qwen2moe"),
        lambda p: p.modules["model.layers.0.self_attn"].inner_wrapper.config.__setitem__(
            "block", 128
        ),
        lambda p: setattr(p.modules["lm_head"], "_tp_local_attr_plan", {}),
        lambda p: setattr(p.modules["lm_head"], "_deferred_bias_params", ("bias",)),
        lambda p: setattr(p.modules["lm_head"], "_is_terminal", False),
        lambda p: setattr(p.modules["lm_head"], "_needs_cp_attn", True),
        lambda p: setattr(p.modules["lm_head"], "_ep_stack", {"w": ["experts.0.w"]}),
        lambda p: setattr(p.modules["lm_head"], "_ep_size", 2),
        lambda p: setattr(p, "mesh_shape", (4, 1)),
        lambda p: setattr(p, "sequence_parallel", False),
        lambda p: setattr(p, "loss_parallel", True),
        lambda p: setattr(p, "ep_size", 2),
        lambda p: setattr(p, "modules", dict(reversed(list(p.modules.items())))),
    ],
)
def test_fingerprint_covers_everything_that_affects_execution(mutate):
    plan = make_plan()
    fp = plan.fingerprint()
    mutate(plan)
    assert plan.fingerprint() != fp


@local_compute
def _factory(module, ctx):
    return None


def test_fingerprint_names_callables_by_qualname():
    @local_compute
    def nested(module, ctx):
        return None

    plan = make_plan()
    plan.modules["lm_head"].local_compute_fn = _factory
    fp1 = plan.fingerprint()
    plan.modules["lm_head"].local_compute_fn = nested  # not importable: still fingerprinted
    fp2 = plan.fingerprint()
    assert fp1 != fp2
    assert plan.fingerprint() == fp2


def test_fingerprint_of_callables_without_a_qualname():
    import functools

    plan = make_plan()
    plan.modules["lm_head"].local_compute_fn = functools.partial(_factory)
    fp = plan.fingerprint()
    plan.modules["lm_head"].local_compute_fn = functools.partial(_factory, module=None)
    assert plan.fingerprint() == fp  # named by type: functools.partial


# ----------------------------------------------------------------------- copy


def test_copy_is_deep_enough():
    plan = make_plan(notes=["n"])
    plan["model.layers.0.self_attn"]._ep_stack = {"w": ["experts.0.w"]}
    before = make_plan(notes=["n"])
    before["model.layers.0.self_attn"]._ep_stack = {"w": ["experts.0.w"]}
    dup = plan.copy()
    assert dup == plan and dup is not plan and dup.notes == ["n"]
    spec = dup["model.layers.0.self_attn"]
    spec.params["q_proj.weight"]["tp"] = Replicate()
    spec.params["new.weight"] = {"tp": Shard(0)}
    spec.in_src["hidden_states"]["cp"] = Shard(1)
    spec.out_src["output"]["tp"] = Replicate()
    spec.inner_wrapper.config["block"] = 1
    spec._tp_local_attr_plan["num_kv_heads"] = (4, 1)
    spec._ep_stack["w"].append("experts.1.w")
    spec.is_boundary = False
    dup.modules["extra"] = ModuleShardingSpec()
    dup.notes.append("more")
    assert plan == before
    assert plan.notes == ["n"]


def test_copy_spec_shares_runtime_fields():
    spec = attn_spec()
    marker = object()
    spec._resolved_inner_wrapper = marker
    dup = copy_spec(spec)
    assert dup == spec
    assert dup._resolved_inner_wrapper is marker
    assert dup.params is not spec.params and dup.inner_wrapper is not spec.inner_wrapper
    assert isinstance(dup.inner_wrapper, Target)
