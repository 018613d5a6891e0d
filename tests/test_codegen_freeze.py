"""freeze / rebuild round trips on every supported model, write conditions, value forms, freeze
errors."""

from __future__ import annotations

import json

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from hp_core import ModuleShardingSpec, ShardingPlan, Target, inner_wrapper, local_compute, plan
from hp_core.artifact import (
    FreezeError,
    canonical_json,
    freeze,
    plan_differences,
    rebuild,
    same_plan,
)
from hp_core.presets import build_model
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)
from tests._toy_models import list_moe_lm

pytestmark = pytest.mark.usefixtures("builtin_only")  # plans from the core's own templates only

CP_OVERRIDES = [
    {
        "match": "model.layers.*.self_attn",
        "inner_wrapper": "sdpa_hf",
        "inner_target": "self",
        "region_dispatch": False,
    }
]

# (family, mesh, plan keyword arguments): every model and axis combination the project supports.
CASES = [
    *[
        (f, "tp=2", {"sequence_parallel": sp})
        for f in ("llama", "qwen2", "mistral")
        for sp in (True, False)
    ],
    ("llama", "tp=2", {"loss_parallel": True}),
    ("qwen2", "dp=2,tp=2", {"loss_parallel": True, "sequence_parallel": False}),
    ("qwen2moe", "tp=2,ep=2", {"ep_size": 2}),
    ("mixtral", "tp=2,ep=2", {"ep_size": 2}),
    ("llama", "cp=2", {"overrides": CP_OVERRIDES}),
    ("qwen2", "tp=2,cp=2", {"overrides": CP_OVERRIDES}),
]


@inner_wrapper
def module_level_wrapper(target_module, ctx):
    return target_module.forward


@local_compute
def module_level_factory(ctx, scale: float = 1.0):
    return lambda module, x: x


def _plan(spec: ModuleShardingSpec, **plan_kwargs) -> ShardingPlan:
    return ShardingPlan({"m": spec}, ("tp",), (2,), **plan_kwargs)


def _round_trip(p: ShardingPlan) -> tuple[dict, ShardingPlan]:
    meta = freeze(p)
    return meta, rebuild(json.loads(canonical_json(meta)))


@pytest.mark.parametrize(
    "family,mesh,kwargs", CASES, ids=lambda c: str(c) if isinstance(c, str) else None
)
def test_round_trip_on_every_supported_model(family, mesh, kwargs):
    # Built-in templates only, on purpose: the cp cases name sdpa_hf, which is not loaded.
    live = plan(build_model(family, device="meta"), mesh, check_items=False, **kwargs)
    meta = freeze(live)
    data = canonical_json(meta)
    assert canonical_json(freeze(live)) == data  # freezing twice: identical bytes
    loaded = json.loads(data)
    rebuilt = rebuild(loaded)
    assert freeze(rebuilt) == loaded == meta  # freeze(rebuild(meta)) == meta
    assert canonical_json(freeze(rebuilt)) == data
    assert plan_differences(live, rebuilt) == [] and same_plan(rebuilt, live)
    assert list(rebuilt) == list(live)  # model order survives sorted keys
    assert [r["match"] for r in meta["param_plan"]] == list(live)


def test_meta_layout_for_a_cp_plan():
    live = plan(
        build_model("llama", device="meta"), "cp=2", overrides=CP_OVERRIDES, check_items=False
    )
    meta = freeze(live)
    assert {k: meta[k] for k in ("mesh", "sequence_parallel", "loss_parallel", "ep_size")} == {
        "mesh": {"axis_names": ["cp"], "shape": [2]},
        "sequence_parallel": True,
        "loss_parallel": False,
        "ep_size": 1,
    }
    assert meta["injections"] == [
        {"match": f"model.layers.{i}.self_attn", "inner_wrapper": "sdpa_hf", "inner_target": "self"}
        for i in range(2)
    ]
    attn = next(r for r in meta["param_plan"] if r["match"] == "model.layers.0.self_attn")
    assert list(attn) == [
        "match",
        "params",
        "in_src",
        "in_dst",
        "out_src",
        "out_dst",
        "out_names",
        "is_boundary",
        "region_dispatch",
    ]
    assert attn["params"]["q_proj.weight"] == {"cp": "replicate"}
    assert attn["in_src"] == {"hidden_states": {"cp": "shard(1)"}}
    assert attn["region_dispatch"] is False


def test_ep_plans_carry_size_and_stack():
    live = plan(list_moe_lm(), "tp=2,ep=2", ep_size=2)
    meta, rebuilt = _round_trip(live)
    rule = meta["injections"][0]
    assert rule["match"] == "model.layers.0.block_sparse_moe" and rule["ep_size"] == 2
    assert rule["ep_stack"]["experts.w1.weight"] == [f"experts.{i}.w1.weight" for i in range(4)]
    assert (
        rebuilt["model.layers.0.block_sparse_moe"]._ep_stack
        == live["model.layers.0.block_sparse_moe"]._ep_stack
    )
    assert rebuilt["model.layers.1.block_sparse_moe"]._ep_size == 2
    assert same_plan(live, rebuilt) and freeze(rebuilt) == meta


def test_explicit_empty_values_survive():
    spec = ModuleShardingSpec(
        params={}, in_src={}, in_dst={}, out_src={}, out_dst={}, tp_divide_attrs=[]
    )
    meta, rebuilt = _round_trip(_plan(spec))
    assert meta["param_plan"] == [
        {
            "match": "m",
            "params": {},
            "in_src": {},
            "in_dst": {},
            "out_src": {},
            "out_dst": {},
            "tp_divide_attrs": [],
            "is_boundary": True,
        }
    ]
    assert (
        rebuilt["m"].params == {}
        and rebuilt["m"].tp_divide_attrs == []
        and rebuilt["m"].out_src == {}
    )


def test_unset_and_falsy_values_are_left_out():
    spec = ModuleShardingSpec(out_names=[], skip_source_lowering=False, is_boundary=False)
    meta, rebuilt = _round_trip(_plan(spec))
    assert meta["param_plan"] == [{"match": "m", "is_boundary": False}]
    assert meta["injections"] == []
    r = rebuilt["m"]
    assert (
        r.params,
        r.out_names,
        r.tp_divide_attrs,
        r.region_dispatch,
        r.skip_source_lowering,
    ) == (None,) * 5
    assert (r._deferred_bias_params, r._ep_stack, r._ep_size, r.is_boundary) == ((), {}, 0, False)
    assert same_plan(_plan(spec), rebuilt)  # [] / False / 0 are "unset" for truthy kinds


def test_every_field_written():
    spec = ModuleShardingSpec(
        params={"w": {"tp": Shard(0)}},
        in_src={"x": {"tp": Shard(1), "cp": Replicate()}},
        in_dst={"x": {"tp": "replicate"}},
        out_src={"tp": Partial()},
        out_dst={"output": {"tp": "shard(1)"}},
        out_names=["output", "extra"],
        tp_divide_attrs=["num_heads"],
        is_boundary=True,
        skip_source_lowering=True,
        region_dispatch=False,
        inner_target="core",
        inner_wrapper=Target(
            "my_wrapper",
            {"window": 128, "mode": "causal", "ratios": [0.5, 1.0], "opts": {"a": None}},
        ),
        inner_out_src="first_input",
        local_compute_fn="my_factory",
    )
    spec._deferred_bias_params = ("o.bias",)
    spec._ep_stack = {"experts.w": ["experts.0.w", "experts.1.w"]}
    spec._ep_size = 2
    spec._is_terminal = spec._needs_cp_attn = True
    spec._tp_local_attr_plan = {"num_heads": (4, 2)}
    meta, rebuilt = _round_trip(_plan(spec, sequence_parallel=True, loss_parallel=True, ep_size=2))
    assert meta["param_plan"][0] == {
        "match": "m",
        "params": {"w": {"tp": "shard(0)"}},
        "in_src": {"x": {"tp": "shard(1)", "cp": "replicate"}},
        "in_dst": {"x": {"tp": "replicate"}},
        "out_src": {"output": {"tp": "partial"}},
        "out_dst": {"output": {"tp": "shard(1)"}},
        "out_names": ["output", "extra"],
        "tp_divide_attrs": ["num_heads"],
        "is_boundary": True,
        "region_dispatch": False,
        "deferred_bias_params": ["o.bias"],
        "skip_source_lowering": True,
    }
    assert list(meta["param_plan"][0])[1:] == [k for k in meta["param_plan"][0] if k != "match"]
    assert meta["injections"] == [
        {
            "match": "m",
            "inner_wrapper": {
                "_target_": "my_wrapper",
                "window": 128,
                "mode": "causal",
                "ratios": [0.5, 1.0],
                "opts": {"a": None},
            },
            "inner_target": "core",
            "inner_out_src": "first_input",
            "local_compute_fn": "my_factory",
            "ep_stack": {"experts.w": ["experts.0.w", "experts.1.w"]},
            "ep_size": 2,
        }
    ]
    r = rebuilt["m"]
    assert r.inner_wrapper == Target(
        "my_wrapper", {"window": 128, "mode": "causal", "ratios": [0.5, 1.0], "opts": {"a": None}}
    )
    assert r.local_compute_fn == "my_factory" and r.inner_out_src == "first_input"
    assert r._deferred_bias_params == ("o.bias",) and r.skip_source_lowering is True
    # Exempt fields are not carried: they come back at their defaults.
    assert (r._is_terminal, r._needs_cp_attn, r._tp_local_attr_plan) == (False, False, None)
    assert (
        plan_differences(
            _plan(spec, sequence_parallel=True, loss_parallel=True, ep_size=2), rebuilt
        )
        == []
    )
    assert freeze(rebuilt) == meta


def test_inner_out_src_layout_round_trips():
    spec = ModuleShardingSpec(
        inner_target="core", inner_wrapper="w", inner_out_src={"tp": Shard(1)}, region_dispatch=True
    )
    meta, rebuilt = _round_trip(_plan(spec))
    assert meta["injections"][0]["inner_out_src"] == {"output": {"tp": "shard(1)"}}
    assert rebuilt["m"].inner_out_src == {"output": {"tp": Shard(1)}}


def test_a_registry_name_and_a_target_with_that_name_stay_distinct():
    meta, rebuilt = _round_trip(
        _plan(ModuleShardingSpec(local_compute_fn=Target("moe_a2a"), region_dispatch=False))
    )
    assert meta["injections"][0]["local_compute_fn"] == {"_target_": "moe_a2a"}
    assert rebuilt["m"].local_compute_fn == Target("moe_a2a")


def test_a_decorated_callable_freezes_as_its_dotted_path():
    spec = ModuleShardingSpec(
        inner_wrapper=module_level_wrapper,
        inner_target="self",
        local_compute_fn=module_level_factory,
        region_dispatch=False,
    )
    live = _plan(spec)
    meta, rebuilt = _round_trip(live)
    rule = meta["injections"][0]
    assert rule["inner_wrapper"] == {"_target_": f"{__name__}.module_level_wrapper"}
    assert rule["local_compute_fn"] == {"_target_": f"{__name__}.module_level_factory"}
    assert rebuilt["m"].inner_wrapper == Target(f"{__name__}.module_level_wrapper")
    assert same_plan(live, rebuilt)  # a callable and the Target naming it are the same injection
    assert freeze(rebuilt) == meta


def test_plan_without_mesh_sizes():
    p = ShardingPlan({"m": ModuleShardingSpec(params={})}, ("tp",))
    meta, rebuilt = _round_trip(p)
    assert meta["mesh"] == {"axis_names": ["tp"]}
    assert rebuilt.mesh_shape is None and same_plan(p, rebuilt)


# --------------------------------------------------------------- plan equality


def test_plan_differences_names_each_difference():
    a = _plan(ModuleShardingSpec(params={"w": {"tp": Shard(0)}}))
    b = _plan(ModuleShardingSpec(params={"w": {"tp": Shard(1)}}), sequence_parallel=True)
    assert plan_differences(a, b) == [
        "sequence_parallel: False != True",
        "modules['m'].params: {'w': {'tp': Shard(dim=0)}} != {'w': {'tp': Shard(dim=1)}}",
    ]
    c = ShardingPlan({"n": ModuleShardingSpec(), "m": ModuleShardingSpec()}, ("tp",), (2,))
    d = ShardingPlan({"m": ModuleShardingSpec(), "n": ModuleShardingSpec()}, ("tp",), (2,))
    assert plan_differences(c, d) == ["modules: the same modules in a different order"]
    assert plan_differences(c, _plan(ModuleShardingSpec())) == [
        "modules: only in the first ['n'], only in the second []"
    ]
    assert not same_plan(c, d)


def test_exempt_fields_do_not_count_but_dataclass_equality_does():
    a, b = _plan(ModuleShardingSpec()), _plan(ModuleShardingSpec())
    b["m"]._needs_cp_attn = True
    assert same_plan(a, b) and a != b


def test_an_unfreezable_callable_compares_by_identity():
    def local(target_module, ctx):
        return None

    fn = inner_wrapper(local)
    a = _plan(ModuleShardingSpec(inner_wrapper=fn, inner_target="self", region_dispatch=False))
    b = _plan(ModuleShardingSpec(inner_wrapper=fn, inner_target="self", region_dispatch=False))
    assert same_plan(a, b)
    b["m"].inner_wrapper = module_level_wrapper
    assert not same_plan(a, b)


# ------------------------------------------------------------------- freeze errors


def _frozen_error(spec: ModuleShardingSpec) -> str:
    with pytest.raises(FreezeError) as info:
        freeze(_plan(spec))
    return str(info.value)


def _spec_with(**attrs) -> ModuleShardingSpec:
    spec = ModuleShardingSpec()
    for k, v in attrs.items():
        setattr(spec, k, v)
    return spec


def test_freeze_refuses_a_non_plan():
    with pytest.raises(FreezeError, match=r"^freeze: expected a ShardingPlan, got dict\.$"):
        freeze({})


@pytest.mark.parametrize(
    "attrs,message",
    [
        (
            {"params": "auto"},
            "modules['m'].params: expected a mapping of name to {axis: placement}, got "
            "'auto' (an unresolved override sentinel: freeze a finished plan, from plan()).",
        ),
        (
            {"out_dst": "auto"},
            "modules['m'].out_dst: expected a mapping of name to {axis: placement}, got "
            "'auto' (an unresolved override sentinel: freeze a finished plan, from plan()).",
        ),
        (
            {"in_src": 3},
            "modules['m'].in_src: expected a mapping of name to {axis: placement}, got 3.",
        ),
        (
            {"in_src": {"x": {}}},
            "modules['m'].in_src.x: expected a non-empty {axis: placement} mapping, got {}.",
        ),
        (
            {"params": {"w": {"tp": Partial("avg")}}},
            "modules['m'].params.w.tp: placement Partial(avg) has no DSL form; the grammar "
            "is replicate | partial | shard(N)",
        ),
        (
            {"params": {"w": {"tp": 3}}},
            "modules['m'].params.w.tp: expected a placement string, got int 3. Grammar: "
            "replicate | partial | shard(N)",
        ),
        (
            {"out_names": "output"},
            "modules['m'].out_names: expected a list of names, got 'output'.",
        ),
        ({"out_names": ["a", 1]}, "modules['m'].out_names[1]: expected a string, got 1."),
        (
            {"region_dispatch": [True]},
            "modules['m'].region_dispatch: expected a boolean, number or string, got [True].",
        ),
        ({"_ep_size": "2"}, "modules['m']._ep_size: expected an integer or a boolean, got '2'."),
        (
            {"inner_target": ("a",)},
            "modules['m'].inner_target: tuple ('a',) has no JSON form; an artifact holds "
            "strings, numbers, booleans, null, lists and string-keyed mappings. Use a list "
            "(JSON has no tuples).",
        ),
        (
            {"inner_wrapper": 3},
            "modules['m'].inner_wrapper: expected a registry name, a Target, a decorated "
            "function or a layout, got 3.",
        ),
        (
            {"inner_wrapper": Target("w", {"size": (1, 2)})},
            "modules['m'].inner_wrapper.size: tuple (1, 2) has no JSON form",
        ),
        (
            {"inner_wrapper": Target("w", {"eps": float("nan")})},
            "modules['m'].inner_wrapper.eps: nan has no JSON form; use a finite number.",
        ),
        ({"_ep_stack": ["a"]}, "modules['m']._ep_stack: expected a mapping, got ['a']."),
        ({"_ep_stack": {1: ["a"]}}, "modules['m']._ep_stack: keys must be strings, got int 1."),
        (
            {"out_src": {"b": {"tp": Shard(1)}, "a": {"tp": Shard(1)}}},
            "modules['m']: its outputs ['b', 'a'] are ordered only by the key order of "
            "out_src, which an artifact does not keep (canonical JSON sorts keys). Declare "
            "the order: add out_names: ['b', 'a'] to the override for 'm'.",
        ),
    ],
)
def test_freeze_errors_name_module_field_and_fix(attrs, message):
    assert message in _frozen_error(_spec_with(**attrs))


def test_declared_output_order_is_frozen():
    spec = ModuleShardingSpec(
        out_src={"b": {"tp": Shard(1)}, "a": {"tp": Shard(1)}}, out_names=["b", "a"]
    )
    meta, rebuilt = _round_trip(_plan(spec))
    assert meta["param_plan"][0]["out_names"] == ["b", "a"]
    assert rebuilt["m"].output_names() == ["b", "a"]


def test_undecorated_and_unnameable_callables_are_refused():
    def plain(target_module, ctx):
        return None

    assert (
        "modules['m'].inner_wrapper: "
        f"{__name__}.test_undecorated_and_unnameable_callables_are_refused.<locals>.plain is "
        "not decorated with @local_compute or @inner_wrapper, so it cannot be injected; "
        "decorate it (from hp_core)." == _frozen_error(_spec_with(inner_wrapper=plain))
    )
    message = _frozen_error(_spec_with(inner_wrapper=inner_wrapper(plain)))
    assert message.startswith(
        "modules['m'].inner_wrapper: "
        f"{__name__}.test_undecorated_and_unnameable_callables_are_refused.<locals>.plain "
        "cannot be named in an artifact: only a module-level function"
    )
    assert (
        "register it under a name (register_inner_wrapper / register_compute_factory or a plugin)"
        in message
    )
    lam = inner_wrapper(lambda target_module, ctx: None)
    assert "<lambda> cannot be named in an artifact" in _frozen_error(_spec_with(inner_wrapper=lam))
    plain.__module__ = "__main__"
    plain.__qualname__ = "plain"
    assert "__main__.plain cannot be named in an artifact" in _frozen_error(
        _spec_with(inner_wrapper=plain)
    )
