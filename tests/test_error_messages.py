"""Errors that teach (issue 11, item 5): each refusal is a specific HpError subclass (with its
builtin base) whose message names the culprit and the fix, and the thing refused is unchanged."""

from __future__ import annotations

import copy
import importlib
import inspect
import re

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import hp_core
from hp_core import HpError, plan
from hp_core.injection import InjectionCallError, InjectionMeta, Target, local_compute
from hp_core.mesh import MeshSpecError
from hp_core.planner.lints import MeshTypeError, PlanningError, TemplateBuildError
from hp_core.planner.templates import BoundaryTemplate, Role, RoleRule
from hp_core.plans import (
    ArgumentTypeError,
    DuplicateOverrideError,
    OverrideEntry,
    OverrideError,
    OverridesTypeError,
    PlanTypeError,
    PlanYAMLError,
    ShardingPlan,
    dump_plan,
    load_overrides,
    load_plan,
)
from hp_core.plugins import TEMPLATE_REGISTRY, register_compute_factory, register_template
from hp_core.resolve import resolve_injection
from hp_core.spec import (
    ModuleShardingSpec,
    PlacementSyntaxError,
    SpecValidationError,
    UnknownFieldError,
    UnsupportedPartialError,
    parse_placement,
)
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)
from tests._plugin_fakes import FakePlugins, clean_plugin_env
from tests._toy_models import head_attention_lm


def _params(model: nn.Module) -> list[tuple[str, int, torch.Tensor]]:
    return [(n, id(p), p.detach().clone()) for n, p in model.named_parameters()]


def _same_params(model: nn.Module, before: list[tuple[str, int, torch.Tensor]]) -> bool:
    now = list(model.named_parameters())
    return len(now) == len(before) and all(
        n == m and id(p) == i and torch.equal(p.detach(), v)
        for (n, p), (m, i, v) in zip(now, before, strict=True)
    )


# ------------------------------------------------------- 1. unknown keyword arguments


def _noop_build(ctx):
    return None


@pytest.mark.parametrize(
    ("construct", "typo", "meant"),
    [
        (lambda: ModuleShardingSpec(in_scr={"x": {"tp": "replicate"}}), "in_scr", "in_src"),
        (lambda: ModuleShardingSpec(local_compute={}), "local_compute", "local_compute_fn"),
        (
            lambda: RoleRule("user.rule", r"x$", Role.NORM, architecture=("A",)),
            "architecture",
            "architectures",
        ),
        (lambda: RoleRule(name="user.rule", patern=r"x$", role=Role.NORM), "patern", "pattern"),
        (lambda: BoundaryTemplate("user.norm", "norm", biuld=_noop_build), "biuld", "build"),
        (lambda: Target("w", confg={"a": 1}), "confg", "config"),
        (lambda: OverrideEntry("m", ModuleShardingSpec(), wen="tp"), "wen", "when"),
        (
            lambda: ShardingPlan(modules={}, mesh_axis_name=("tp",)),
            "mesh_axis_name",
            "mesh_axis_names",
        ),
        (lambda: InjectionMeta("local_compute", (), config_key=()), "config_key", "config_keys"),
        (lambda: hp_core.MeshSpec(axis_name=("tp",), sizes=(2,)), "axis_name", "axis_names"),
        (
            lambda: hp_core.VerifyReport(fingerprint="x", mesh=(), reducions=()),
            "reducions",
            "reductions",
        ),
    ],
    ids=[
        "spec",
        "spec-injection",
        "rolerule",
        "rolerule-kw",
        "template",
        "target",
        "override-entry",
        "plan",
        "meta",
        "mesh",
        "report",
    ],
)
def test_unknown_keyword_suggests_the_field(construct, typo, meant):
    with pytest.raises(UnknownFieldError) as e:
        construct()
    assert isinstance(e.value, HpError) and isinstance(e.value, TypeError)
    msg = str(e.value)
    assert f"unknown field {typo!r}" in msg
    assert f"Did you mean {meant!r}?" in msg and f"rename it to {meant!r}" in msg


def test_internal_field_is_not_a_constructor_argument():
    with pytest.raises(
        UnknownFieldError, match=r"'_ep_size' is an internal field that hp sets itself"
    ) as e:
        ModuleShardingSpec(_ep_size=2)
    assert isinstance(e.value, TypeError) and "in_src" in str(e.value)
    # the checked constructors keep their signature and their positional form
    assert "in_src" in inspect.signature(ModuleShardingSpec).parameters
    assert RoleRule("user.rule", r"x$", Role.NORM).architectures == ()


# --------------------------------------------------------- 2. ASCII digits only


@pytest.mark.parametrize(
    ("text", "fixed"),
    [
        ("shard(\u0661)", "shard(1)"),
        ("shard(\u0967)", "shard(1)"),
        ("shard(\uff12)", "shard(2)"),
        ("shard(1\u0660)", "shard(10)"),
        ("shard(\u00b2)", None),
    ],
    ids=["arabic-indic", "devanagari", "fullwidth", "mixed", "superscript"],
)
def test_placement_digits_are_ascii_only(text, fixed):
    with pytest.raises(PlacementSyntaxError) as e:
        parse_placement(text, path="overrides[0].params.w.tp")
    assert isinstance(e.value, HpError) and isinstance(e.value, ValueError)
    msg = str(e.value)
    assert msg.startswith(f"overrides[0].params.w.tp: {text!r} is not a placement")
    assert "digits 0-9 only" in msg
    if fixed is not None:
        assert f"Fix: write {fixed!r}." in msg
    # the same text in a spec and in a YAML override
    with pytest.raises(SpecValidationError, match=re.escape(repr(text))):
        ModuleShardingSpec(params={"w": {"tp": text}})
    with pytest.raises(OverrideError, match=r"^overrides\[0\]\.params\.w\.tp: .*digits 0-9 only"):
        load_overrides([{"match": "m", "params": {"w": {"tp": text}}}])
    assert parse_placement(" Shard ( 10 ) ") == Shard(10)


# ------------------------------------------------------ 3. only partial(sum) lowers


def _mask_partial() -> Partial:
    try:
        from torch.distributed.tensor._ops._embedding_ops import MaskPartial
    except ImportError:  # older torch
        from torch.distributed.tensor._ops._embedding_ops import _MaskPartial as MaskPartial
    return MaskPartial()


@pytest.mark.parametrize(
    ("build", "culprit"),
    [
        (
            lambda: ModuleShardingSpec(out_src={"tp": Partial("max")}),
            "ModuleShardingSpec.out_src.tp: Partial('max') is not supported",
        ),
        (
            lambda: ModuleShardingSpec(params={"w": {"tp": Partial("avg")}}),
            "ModuleShardingSpec.params.w.tp: Partial('avg') is not supported",
        ),
        (
            lambda: ModuleShardingSpec(inner_out_src={"tp": Partial("min")}),
            "ModuleShardingSpec.inner_out_src.tp: Partial('min')",
        ),
        (
            lambda: ModuleShardingSpec(out_src={"tp": _mask_partial()}),
            "a Partial subclass, reduce op 'sum'",
        ),
        (
            lambda: parse_placement("partial(max)", path="p"),
            "p: 'partial(max)': partial(max) is not supported",
        ),
        (
            lambda: ModuleShardingSpec(out_dst={"tp": "Partial ( avg )"}),
            "'Partial ( avg )': partial(avg) is not supported",
        ),
    ],
    ids=["python-max", "python-avg", "inner-out", "mask-partial", "dsl", "dsl-in-spec"],
)
def test_partial_other_than_sum_is_refused_when_the_spec_is_built(build, culprit):
    with pytest.raises(UnsupportedPartialError) as e:
        build()
    assert isinstance(e.value, HpError) and isinstance(e.value, ValueError)
    assert isinstance(e.value, SpecValidationError) and isinstance(e.value, PlacementSyntaxError)
    msg = str(e.value)
    assert culprit in msg
    assert "only partial(sum) is" in msg and "write 'partial'" in msg


@pytest.mark.usefixtures("builtin_only")
def test_partial_in_overrides_names_the_module_and_leaves_them_unchanged():
    model = head_attention_lm()
    entries = [{"match": "model.layers.0.mlp", "out_src": {"tp": "partial(max)"}}]
    before = copy.deepcopy(entries)
    with pytest.raises(OverrideError) as e:
        plan(model, "tp=2", overrides=entries)
    assert isinstance(e.value, HpError) and isinstance(e.value, ValueError)
    assert isinstance(e.value.__cause__, UnsupportedPartialError)
    msg = str(e.value)
    assert msg.startswith("overrides[0].out_src.tp (module 'model.layers.0.mlp'): 'partial(max)'")
    assert "only partial(sum) is" in msg
    assert entries == before
    # a spec whose field was assigned after construction is checked when it is resolved
    spec = ModuleShardingSpec(out_src={"tp": Replicate()})
    spec.out_src = {"output": {"tp": Partial("max")}}
    with pytest.raises(
        OverrideError,
        match=r"^overrides\['model\.layers\.0\.mlp'\]\.out_src\.output\.tp \(module "
        r"'model\.layers\.0\.mlp'\): Partial\('max'\)",
    ):
        plan(model, "tp=2", overrides={"model.layers.0.mlp": spec})
    assert spec.out_src == {"output": {"tp": Partial("max")}}


@pytest.mark.usefixtures("builtin_only")
def test_sum_partials_and_internal_masked_partials_still_work():
    assert ModuleShardingSpec(out_src={"tp": Partial("sum")}).out_src == {
        "output": {"tp": Partial()}
    }
    assert parse_placement("partial(sum)") == parse_placement("PARTIAL") == Partial()
    from hp_core.runtime.layouts import same_placement

    assert same_placement(_mask_partial(), Partial())  # the vocab-parallel lookup's output
    p = plan(head_attention_lm(), "tp=2", loss_parallel=False)
    assert load_plan(dump_plan(p)) == p


# ------------------------------------------------- 4. two exact entries, one module


@pytest.mark.usefixtures("builtin_only")
def test_two_exact_entries_for_one_module_are_refused(tmp_path):
    model = head_attention_lm()
    entries = [
        {"match": "model.layers.0.mlp", "out_dst": {"tp": "replicate"}},
        {"match": "model.layers.*.mlp", "out_dst": {"tp": "replicate"}},  # a glob may overlap
        {"match": "model.layers.0.mlp", "in_src": {"x": {"tp": "replicate"}}},
    ]
    before = copy.deepcopy(entries)
    with pytest.raises(DuplicateOverrideError) as e:
        plan(model, "tp=2", overrides=entries)
    assert (
        isinstance(e.value, OverrideError)
        and isinstance(e.value, HpError)
        and isinstance(e.value, ValueError)
    )
    msg = str(e.value)
    assert msg.startswith(
        "overrides[0] and overrides[2] are both exact overrides for module "
        "'model.layers.0.mlp' (no 'when')"
    )
    assert (
        "overrides[0] (entry 0): {match: model.layers.0.mlp, out_dst: {output: {tp: replicate}}}"
        in msg
    )
    assert (
        "overrides[2] (entry 2): {match: model.layers.0.mlp, in_src: {x: {tp: replicate}}}" in msg
    )
    assert "Fix: merge them into one entry for 'model.layers.0.mlp'" in msg
    assert entries == before
    # the same from YAML, and from Python entries with the same 'when'
    text = (
        "- match: lm_head\n  when: tp\n  out_dst: {tp: replicate}\n- match: lm_head\n  when: tp\n"
        "  out_names: [logits]\n"
    )
    with pytest.raises(
        DuplicateOverrideError,
        match=r"^overrides\[0\] and overrides\[1\] .* 'lm_head' \(when: tp\)",
    ):
        load_overrides(text)
    path = tmp_path / "overrides.yaml"
    path.write_text(text)
    with pytest.raises(DuplicateOverrideError, match=re.escape(f"(in {path})")):
        load_overrides(str(path))
    spec = ModuleShardingSpec(out_dst={"tp": Replicate()})
    with pytest.raises(DuplicateOverrideError, match=r"overrides\[0\] and overrides\[1\]"):
        load_overrides([OverrideEntry("lm_head", spec), OverrideEntry("lm_head", spec)])
    # merged into one entry it plans
    merged = [
        {
            "match": "model.layers.0.mlp",
            "out_dst": {"tp": "replicate"},
            "in_src": {"x": {"tp": "replicate"}},
        }
    ]
    assert plan(model, "tp=2", overrides=merged)["model.layers.0.mlp"].in_src == {
        "x": {"tp": Replicate()}
    }


@pytest.mark.usefixtures("builtin_only")
def test_exact_entries_with_different_conditions_layer():
    entries = [
        {"match": "lm_head", "out_dst": {"tp": "replicate"}},
        {"match": "lm_head", "when": "cp", "out_names": ["logits"]},
    ]
    assert len(load_overrides(entries)) == 2
    p = plan(head_attention_lm(), "tp=2", overrides=entries)  # cp inactive: the second is skipped
    assert (
        p["lm_head"].out_dst == {"output": {"tp": Replicate()}} and p["lm_head"].out_names is None
    )


# --------------------------------------------------- 5. arguments of the wrong type


@pytest.mark.usefixtures("builtin_only")
@pytest.mark.parametrize(
    ("call", "cls", "bases", "fragments"),
    [
        (
            lambda m: plan(None, "tp=2"),
            ArgumentTypeError,
            (TypeError,),
            ["plan(model, mesh): model must be a torch.nn.Module, got NoneType None"],
        ),
        (
            lambda m: plan("meta-llama/Llama-3-8B", "tp=2"),
            ArgumentTypeError,
            (TypeError,),
            ["got str 'meta-llama/Llama-3-8B'", "not its name or path"],
        ),
        (
            lambda m: plan(m, None),
            MeshTypeError,
            (TypeError, ValueError, MeshSpecError),
            [
                "plan(model, mesh): mesh: expected a DeviceMesh, a MeshSpec",
                "got NoneType None",
                "hp_core.plan(model, 'tp=2')",
            ],
        ),
        (lambda m: plan(m, 8), MeshTypeError, (TypeError, ValueError), ["got int 8"]),
        (
            lambda m: plan(m, "tp=2", overrides=42),
            OverridesTypeError,
            (TypeError, ValueError, OverrideError),
            ["overrides: expected YAML text", "got int 42"],
        ),
        (
            lambda m: plan(m, "tp=2", overrides=ModuleShardingSpec()),
            OverridesTypeError,
            (TypeError,),
            ["Key a spec by the module it overrides"],
        ),
        (
            lambda m: load_plan(None),
            PlanTypeError,
            (TypeError, ValueError, PlanYAMLError),
            ["a plan: expected YAML text or a file path, got NoneType None"],
        ),
        (lambda m: load_plan(plan(m, "tp=2")), PlanTypeError, (TypeError,), ["it is one already"]),
        (
            lambda m: dump_plan({"modules": {}}),
            PlanTypeError,
            (TypeError, ValueError),
            ["dump_plan: expected a ShardingPlan, got dict"],
        ),
        (
            lambda m: load_overrides(3.5),
            OverridesTypeError,
            (TypeError, ValueError),
            ["got float 3.5"],
        ),
    ],
    ids=[
        "plan-none",
        "plan-name",
        "mesh-none",
        "mesh-int",
        "overrides-int",
        "overrides-spec",
        "load-none",
        "load-plan",
        "dump-dict",
        "load-overrides",
    ],
)
def test_wrong_argument_types_name_the_argument(call, cls, bases, fragments):
    model = head_attention_lm()
    before = _params(model)
    with pytest.raises(cls) as e:
        call(model)
    assert isinstance(e.value, HpError) and all(isinstance(e.value, b) for b in bases)
    for fragment in fragments:
        assert fragment in str(e.value)
    assert _same_params(model, before)


# ------------------------------------- 6. the suggested name of a user rule registers


@pytest.mark.usefixtures("builtin_only")
def test_user_rule_named_user_family_n_registers():
    from hp_core.plugins import InvalidRegistrationError

    name = "user.phi3.0"
    try:
        item = register_template(
            RoleRule(name, r"\.qkv_proj\.weight$", Role.FUSED_QKV, ("Phi3ForCausalLM",))
        )
    except InvalidRegistrationError as e:
        suggested = re.search(r"e\.g\. '([^']+)'", str(e))
        assert suggested is None or suggested.group(1) != name, (
            "the fix suggests the name it refuses"
        )
        raise
    assert item.name == name and TEMPLATE_REGISTRY[name].value.role is Role.FUSED_QKV


# ------------------------------------- 7. templates and factories that raise


_BOOM = """
from hp_core.planner.templates import BoundaryTemplate

def _boom(ctx):
    raise KeyError("hidden_size")

@local_compute
def boom_factory(ctx, module):
    raise RuntimeError("no experts in " + type(module).__name__)

@hookimpl
def hp_register_templates(register):
    register(BoundaryTemplate("fakeboom.norm", "norm", _boom, architectures=("ToyCausalLM",)))

@hookimpl
def hp_register_compute_factories(register):
    register("boom_factory", boom_factory)
"""


@pytest.fixture
def boom_plugin(tmp_path, monkeypatch):
    clean_plugin_env(monkeypatch)
    with FakePlugins(tmp_path / "site") as fake:
        fake.plugin("fakeboom", _BOOM, dist="fake-boom", version="0.3")
        yield fake


def _kind_error(ctx):
    raise RuntimeError("template bug")


@pytest.mark.parametrize(
    "source",
    ["plugin", "user"],
)
def test_template_that_raises_names_template_provider_and_module(source, request):
    if source == "plugin":
        request.getfixturevalue("boom_plugin")
        name, provider, original = "fakeboom.norm", "plugin 'fakeboom' (fake-boom 0.3)", KeyError
    else:
        request.getfixturevalue("builtin_only")
        register_template(
            BoundaryTemplate("user.bad_norm", "norm", _kind_error, architectures=("ToyCausalLM",))
        )
        name, provider, original = (
            "user.bad_norm",
            "provider 'user' (a register_* call)",
            RuntimeError,
        )
    model = head_attention_lm()
    before, registered = _params(model), dict(TEMPLATE_REGISTRY)
    with pytest.raises(TemplateBuildError) as e:
        plan(model, "tp=2")
    err = e.value
    assert (
        isinstance(err, PlanningError) and isinstance(err, HpError) and isinstance(err, ValueError)
    )
    assert type(err.__cause__) is original
    msg = str(err)
    assert msg.startswith(
        f"model.layers.0.input_layernorm: boundary template {name!r} (kind 'norm', from "
        f"{provider}) failed to "
        f"build the spec of RMSNorm 'model.layers.0.input_layernorm': {original.__name__}: "
    )
    assert "match: 'model.layers.0.input_layernorm'" in msg
    assert (err.template, err.provider, err.fqn) == (
        name,
        provider,
        "model.layers.0.input_layernorm",
    )
    assert _same_params(model, before) and dict(TEMPLATE_REGISTRY) == registered


@pytest.mark.usefixtures("builtin_only")
def test_template_interrupt_is_not_wrapped():
    def interrupted(ctx):
        raise KeyboardInterrupt

    register_template(
        BoundaryTemplate("user.interrupted", "norm", interrupted, architectures=("ToyCausalLM",))
    )
    with pytest.raises(KeyboardInterrupt):
        plan(head_attention_lm(), "tp=2")


_CONTEXT = {"ctx": None}


@local_compute
def _user_boom(ctx, module, capacity=1.0):
    raise ValueError(f"capacity {capacity} is too small")


@local_compute
def _user_interrupt(ctx):
    raise KeyboardInterrupt


@pytest.mark.parametrize("source", ["plugin", "user"])
def test_factory_that_raises_names_factory_provider_and_module(source, request):
    if source == "plugin":
        request.getfixturevalue("boom_plugin")
        name, provider, original, value = (
            "boom_factory",
            "plugin 'fakeboom' (fake-boom 0.3)",
            RuntimeError,
            "boom_factory",
        )
    else:
        request.getfixturevalue("builtin_only")
        register_compute_factory("user_boom", _user_boom)
        name, provider, original, value = (
            "user_boom",
            "provider 'user' (a register_* call)",
            ValueError,
            Target("user_boom", {"capacity": 0.5}),
        )
    src = "plan['model.layers.0.mlp'].local_compute_fn"
    resolved = resolve_injection(value, "local_compute", source=src)
    module = nn.Linear(2, 2)
    before = copy.deepcopy(module.state_dict())
    with pytest.raises(InjectionCallError) as e:
        resolved.bind({**_CONTEXT, "module": module}, source=src)
    err = e.value
    assert isinstance(err, HpError) and isinstance(err, RuntimeError)
    assert type(err.__cause__) is original
    msg = str(err)
    assert msg.startswith(
        f"{src}: the @local_compute factory {name!r} (from {provider}) failed for module "
        f"'model.layers.0.mlp': {original.__name__}: "
    )
    assert "Fix: if its config is wrong, correct it in the override for 'model.layers.0.mlp'" in msg
    assert (err.name, err.provider, err.fqn, err.kind) == (
        name,
        provider,
        "model.layers.0.mlp",
        "local_compute",
    )
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())
    assert resolved.config == ({} if source == "plugin" else {"capacity": 0.5})


@pytest.mark.usefixtures("builtin_only")
def test_factory_interrupt_and_hp_errors_pass_through():
    resolved = resolve_injection(_user_interrupt, "local_compute", source="s")
    with pytest.raises(KeyboardInterrupt):
        resolved.bind(_CONTEXT, source="s")
    direct = resolve_injection(_user_boom, "local_compute", source="plan['m'].local_compute_fn")
    with pytest.raises(
        InjectionCallError,
        match=r"from a function passed directly \(module tests\.test_error_messages\)",
    ) as e:
        direct.bind({**_CONTEXT, "module": nn.Linear(1, 1)}, source="plan['m'].local_compute_fn")
    assert e.value.fqn == "m"


# --------------------------------------- 8. every error class derives from HpError


#: Exceptions used for control flow inside one module, caught there and never raised to a
#: caller (named one by one, so a new exception class cannot slip in unseen).
_INTERNAL_EXCEPTIONS = {
    "hp_core.cli.failure.CommandFailed",
    "hp_core.plugins._state.PluginFailure",
}
#: Base classes that carry no builtin type of their own (their subclasses do).
_BASES_WITHOUT_BUILTIN = {"hp_core.errors.HpError", "hp_plugin_cp.errors.CPError"}


def _all_modules() -> list[str]:
    """Every module of hp_core and the bundled plugins, except hp_core.testing (assertion
    helpers)."""
    import pkgutil

    import hp_plugin_cp
    import hp_plugin_moe

    names = []
    for package in (hp_core, hp_plugin_cp, hp_plugin_moe):
        names.append(package.__name__)
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name == "hp_core.testing" or info.name.startswith("hp_core.testing."):
                continue
            names.append(info.name)
    return names


def test_the_module_walk_covers_every_layer():
    names = set(_all_modules())
    for expected in (
        "hp_core.bounded",
        "hp_core.cli",
        "hp_core.artifact.signed",
        "hp_core.plugins._registry",
        "hp_core.runtime.preflight",
        "hp_core.verifier.report",
        "hp_core.planner.lints",
        "hp_plugin_cp.errors",
        "hp_plugin_moe",
    ):
        assert expected in names, expected
    assert not any(n.startswith("hp_core.testing") for n in names)


@pytest.mark.parametrize("module_name", _all_modules())
def test_every_error_class_derives_from_hp_error(module_name):
    module = importlib.import_module(module_name)
    classes = [
        c
        for c in vars(module).values()
        if isinstance(c, type)
        and issubclass(c, Exception)
        and not issubclass(c, Warning)
        and c.__module__ == module_name
    ]
    for cls in classes:
        qualified = f"{module_name}.{cls.__qualname__}"
        if qualified in _INTERNAL_EXCEPTIONS:
            continue
        assert issubclass(cls, HpError), f"{qualified} does not derive from HpError"
        if qualified not in _BASES_WITHOUT_BUILTIN:
            assert any(issubclass(cls, b) for b in (ValueError, TypeError, RuntimeError)), qualified


def test_new_errors_are_exported():
    for name in (
        "UnknownFieldError",
        "UnsupportedPartialError",
        "DuplicateOverrideError",
        "ArgumentTypeError",
        "MeshTypeError",
        "PlanTypeError",
        "OverridesTypeError",
        "TemplateBuildError",
        "TemplateDefinitionError",
        "InjectionCallError",
    ):
        assert name in hp_core.__all__ and issubclass(getattr(hp_core, name), HpError)


@pytest.mark.usefixtures("builtin_only")
@pytest.mark.parametrize("bad", ["1abc", "user..phi3", "a b", "user.ph!3.0"])
def test_invalid_template_names_suggest_a_name_that_registers(bad):
    from hp_core.plugins import InvalidRegistrationError

    with pytest.raises(InvalidRegistrationError) as e:
        register_template(
            RoleRule(bad, r"\.qkv_proj\.weight$", Role.FUSED_QKV, ("Phi3ForCausalLM",))
        )
    suggested = re.search(r"e\.g\. '([^']+)'", str(e.value))
    assert suggested is not None and suggested.group(1) != bad, str(e.value)
    item = register_template(
        RoleRule(suggested.group(1), r"\.qkv_proj\.weight$", Role.FUSED_QKV, ("Phi3ForCausalLM",))
    )
    assert TEMPLATE_REGISTRY[item.name].value.role is Role.FUSED_QKV


#: Unpickles the bytes on stdin in a fresh interpreter and prints each error's class, message and
#: fields.
_UNPICKLE = (
    "import json, pickle, sys\n"
    "errors = pickle.loads(sys.stdin.buffer.read())\n"
    "print(json.dumps([[type(e).__module__, type(e).__qualname__, str(e), vars(e)] for e in "
    "errors]))\n"
)


def test_errors_with_keyword_fields_survive_pickling_into_another_process():
    """Errors cross process boundaries (spawned ranks report them): the class and the facts
    must survive unpickling in an interpreter that did not make them."""
    import json
    import os
    import pickle
    import subprocess
    import sys

    errors = [
        InjectionCallError(
            "boom for model.mlp",
            name="f",
            provider="plugin 'x'",
            fqn="model.mlp",
            kind="local_compute",
        ),
        TemplateBuildError(
            "template 't' failed", template="t", provider="plugin 'y'", fqn="model.layers.0"
        ),
    ]
    for e in errors:  # in this process too
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e) and vars(back) == vars(e)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", _UNPICKLE],
        input=pickle.dumps(errors),
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout) == [
        [
            "hp_core.injection",
            "InjectionCallError",
            "boom for model.mlp",
            {"name": "f", "provider": "plugin 'x'", "fqn": "model.mlp", "kind": "local_compute"},
        ],
        [
            "hp_core.planner.lints",
            "TemplateBuildError",
            "template 't' failed",
            {"template": "t", "provider": "plugin 'y'", "fqn": "model.layers.0"},
        ],
    ]
