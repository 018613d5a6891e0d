"""Registries and programmatic registration: views, provenance, validation, error messages."""

from __future__ import annotations

import types
from collections.abc import Mapping

import pytest

from hp_core import resolve
from hp_core.hookspecs import hookimpl
from hp_core.injection import InjectionDefinitionError, inner_wrapper, local_compute
from hp_core.planner import templates
from hp_core.plugins import (
    COMPUTE_FACTORY_REGISTRY,
    INNER_WRAPPER_REGISTRY,
    ROUTER_ADAPTER_REGISTRY,
    TEMPLATE_REGISTRY,
    DuplicateRegistrationError,
    InvalidRegistrationError,
    PluginLoadError,
    PluginRegistry,
    ProtectedRegistryItemError,
    RegisteredItem,
    RegistryKind,
    UnknownRegistryItemError,
    _manager,
    _state,
    lookup,
    plugin_packages,
    plugin_report,
    register_compute_factory,
    register_inner_wrapper,
    register_plugin,
    register_router_adapter,
    register_template,
    registered_items,
    reset_plugins,
    suggest_compute_factory,
    unregister,
)
from tests._plugin_fakes import clean_plugin_env


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    clean_plugin_env(monkeypatch)
    # The registries under test start empty: the installed plugins (hp-plugin-cp, -moe, ...)
    # register real items whose names these tests reuse.
    monkeypatch.setenv("HP_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_plugins()
    yield
    reset_plugins()


@inner_wrapper
def attn_wrapper(target_module, ctx):
    return None


@local_compute
def moe_factory(ctx, capacity=1.0):
    return None


def plain(target_module, ctx):
    return None


def snapshot() -> dict[RegistryKind, dict[str, RegisteredItem]]:
    return {k: dict(PluginRegistry(k)) for k in RegistryKind}


# ------------------------------------------------------------------ views


def test_registries_are_read_only_mappings():
    for registry in (
        TEMPLATE_REGISTRY,
        INNER_WRAPPER_REGISTRY,
        COMPUTE_FACTORY_REGISTRY,
        ROUTER_ADAPTER_REGISTRY,
    ):
        assert isinstance(registry, Mapping)
        assert not hasattr(registry, "__setitem__")
        with pytest.raises(TypeError):
            registry["x"] = None  # type: ignore[index]
        with pytest.raises(TypeError):
            del registry["x"]  # type: ignore[attr-defined]


def test_discovery_is_lazy_and_runs_once(monkeypatch):
    calls = []
    real = _manager.load_all
    monkeypatch.setattr(_manager, "load_all", lambda: calls.append(1) or real())
    reset_plugins()
    assert _manager._STATE is None
    assert calls == []
    len(TEMPLATE_REGISTRY)
    "x" in INNER_WRAPPER_REGISTRY  # noqa: B015
    plugin_report()
    assert calls == [1]
    reset_plugins()
    list(COMPUTE_FACTORY_REGISTRY)
    assert calls == [1, 1]


def test_builtin_plugin_registers_default_role_rules_through_the_hook():
    from hp_core.planner.templates.builtin import DEFAULT_BOUNDARY_TEMPLATES
    from hp_core.planner.templates.linear import SINGLE_MODULE_TEMPLATES

    names = [
        r.name
        for r in (
            *templates.DEFAULT_ROLE_RULES,
            *DEFAULT_BOUNDARY_TEMPLATES,
            *SINGLE_MODULE_TEMPLATES,
        )
    ]
    builtin = [i for i in TEMPLATE_REGISTRY.values() if i.provider == "builtin"]
    assert [i.name for i in builtin] == names
    assert all(i.distribution == "hp-core" and i.kind is RegistryKind.TEMPLATE for i in builtin)
    assert TEMPLATE_REGISTRY[names[0]].value is templates.DEFAULT_ROLE_RULES[0]
    first = plugin_report()[0]
    assert (first.name, first.distribution, first.status, first.items) == (
        "builtin",
        "hp-core",
        "builtin",
        len(names) + 1,  # and its one inner wrapper, sharded_qk_norm
    )
    assert "hp_core" in plugin_packages()


# ------------------------------------------------------------------ user registration


def test_register_inner_wrapper_records_user_provenance_and_meta():
    item = register_inner_wrapper(
        "my_attn", attn_wrapper, needs_cp=True, region_dispatch=False, forward_style="qkv"
    )
    assert INNER_WRAPPER_REGISTRY["my_attn"] is item
    assert lookup("inner_wrapper", "my_attn") is item
    assert (item.kind, item.name, item.value, item.provider, item.distribution, item.version) == (
        RegistryKind.INNER_WRAPPER,
        "my_attn",
        attn_wrapper,
        "user",
        None,
        None,
    )
    assert dict(item.meta) == {"needs_cp": True, "region_dispatch": False, "forward_style": "qkv"}
    with pytest.raises(TypeError):
        item.meta["needs_cp"] = False  # type: ignore[index]
    assert [i for i in registered_items("inner_wrapper") if i.provider != "builtin"] == [item]


def test_registered_item_resolves_through_injection_lookup():
    register_inner_wrapper("resolvable", attn_wrapper)
    resolved = resolve.resolve_injection("resolvable", "inner_wrapper", source="test")
    assert resolved.fn is attn_wrapper
    assert resolved.provider == "user"


def test_register_compute_factory_and_suggestion():
    register_compute_factory(
        "my_moe", moe_factory, architectures=("Qwen2MoeForCausalLM", "MixtralForCausalLM")
    )
    assert COMPUTE_FACTORY_REGISTRY["my_moe"].meta["architectures"] == (
        "Qwen2MoeForCausalLM",
        "MixtralForCausalLM",
    )
    assert suggest_compute_factory("MixtralForCausalLM") == "my_moe"
    assert suggest_compute_factory("LlamaForCausalLM") is None


def test_two_factories_cannot_claim_one_architecture():
    register_compute_factory("first", moe_factory, architectures=("MixtralForCausalLM",))
    before = snapshot()
    with pytest.raises(DuplicateRegistrationError) as e:
        register_compute_factory("second", moe_factory, architectures=("MixtralForCausalLM",))
    msg = str(e.value)
    assert "'second'" in msg and "'first'" in msg and "'MixtralForCausalLM'" in msg
    assert snapshot() == before


def test_register_router_adapter_and_template():
    def adapter(logits):
        return logits

    assert register_router_adapter("softmax_topk", adapter).value is adapter
    assert ROUTER_ADAPTER_REGISTRY["softmax_topk"].provider == "user"
    rule = templates.RoleRule("mine.qkv", r"qkv$", templates.Role.FUSED_QKV, ("MyForCausalLM",))
    item = register_template(rule)
    assert TEMPLATE_REGISTRY["mine.qkv"] is item
    assert item.meta["architectures"] == ("MyForCausalLM",)
    assert item.meta["type"] == "RoleRule"


def test_duplicate_user_registration_names_both_providers_and_changes_nothing():
    first = register_inner_wrapper("dup", attn_wrapper)
    before = snapshot()
    with pytest.raises(DuplicateRegistrationError) as e:
        register_inner_wrapper("dup", attn_wrapper, needs_cp=True)
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    assert msg.splitlines()[0] == (
        "provider 'user' (a register_* call): inner wrapper 'dup' is already registered by "
        "provider 'user' (a register_* call)."
    )
    assert "unregister('inner_wrapper', 'dup')" in msg
    assert snapshot() == before
    assert INNER_WRAPPER_REGISTRY["dup"] is first


def test_duplicate_of_a_plugin_item_names_the_plugin_and_distribution():
    rule = templates.RoleRule("role.embed", r"x", templates.Role.EMBED)
    with pytest.raises(DuplicateRegistrationError) as e:
        register_template(rule)
    first = str(e.value).splitlines()[0]
    assert "provider 'user'" in first
    assert "plugin 'builtin' (hp-core" in first
    assert TEMPLATE_REGISTRY["role.embed"].provider == "builtin"


def test_undecorated_function_is_rejected_with_the_decorator_to_use():
    before = snapshot()
    with pytest.raises(InjectionDefinitionError) as e:
        register_inner_wrapper("plain", plain)
    assert isinstance(e.value, TypeError)
    assert (
        "plain" in str(e.value) and "@inner_wrapper" in str(e.value) and "'plain'" in str(e.value)
    )
    with pytest.raises(TypeError, match="@local_compute"):
        register_compute_factory("plain", plain)
    assert snapshot() == before


def test_wrong_decorator_kind_is_rejected():
    with pytest.raises(
        TypeError, match="decorated with @local_compute but is used where @inner_wrapper"
    ):
        register_inner_wrapper("wrong", moe_factory)
    with pytest.raises(
        TypeError, match="decorated with @inner_wrapper but is used where @local_compute"
    ):
        register_compute_factory("wrong", attn_wrapper)


@pytest.mark.parametrize("name", ["has.dot", "", "1abc", "with space", 3, None])
def test_bad_names_are_rejected(name):
    before = snapshot()
    with pytest.raises(InvalidRegistrationError) as e:
        register_inner_wrapper(name, attn_wrapper)  # type: ignore[arg-type]
    lines = str(e.value).splitlines()
    assert (
        lines[0].startswith("provider 'user' (a register_* call), inner wrapper")
        and repr(name) in lines[0]
    )
    assert "no dots" in lines[1]
    assert lines[2].startswith("Fix:")
    assert snapshot() == before


def test_bad_name_suggests_a_valid_one():
    with pytest.raises(InvalidRegistrationError, match=r"e\.g\. 'my_attn'"):
        register_inner_wrapper("my.attn", attn_wrapper)
    with pytest.raises(InvalidRegistrationError, match=r"e\.g\. '_1abc'"):
        register_router_adapter("1abc", len)


def test_template_names_may_be_dotted_but_not_arbitrary():
    ok = templates.RoleRule("family.sub.rule", r"x", templates.Role.NORM)
    assert register_template(ok).name == "family.sub.rule"
    with pytest.raises(InvalidRegistrationError, match="optionally namespaced with dots"):
        register_template(templates.RoleRule("bad name", r"x", templates.Role.NORM))
    with pytest.raises(InvalidRegistrationError, match="no 'name' attribute"):
        register_template(object())


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"needs_cp": "yes"}, "needs_cp='yes' is not valid"),
        ({"needs_cp": None}, "needs_cp must be True or False"),
        ({"region_dispatch": "no"}, "region_dispatch must be None, True or False"),
        ({"forward_style": "qvk"}, "forward_style='qvk' is not valid. Did you mean 'qkv'?"),
    ],
)
def test_bad_inner_wrapper_options(kwargs, fragment):
    with pytest.raises(InvalidRegistrationError) as e:
        register_inner_wrapper("opt", attn_wrapper, **kwargs)
    assert fragment in str(e.value)
    assert "opt" not in INNER_WRAPPER_REGISTRY


def test_bad_architectures():
    with pytest.raises(
        InvalidRegistrationError, match=r"Fix: pass architectures=\('MixtralForCausalLM',\)"
    ):
        register_compute_factory("f", moe_factory, architectures="MixtralForCausalLM")  # type: ignore[arg-type]
    with pytest.raises(InvalidRegistrationError, match="architecture 'not a class' is not valid"):
        register_compute_factory("f", moe_factory, architectures=("not a class",))
    with pytest.raises(InvalidRegistrationError, match="architectures=3 is not valid"):
        register_compute_factory("f", moe_factory, architectures=3)  # type: ignore[arg-type]
    assert "f" not in COMPUTE_FACTORY_REGISTRY


def test_non_callables_are_rejected():
    with pytest.raises(InvalidRegistrationError, match="router adapter 42 is not callable"):
        register_router_adapter("r", 42)  # type: ignore[arg-type]
    with pytest.raises(InvalidRegistrationError, match="not callable"):
        register_inner_wrapper("w", "sdpa_qkv")  # type: ignore[arg-type]


# ------------------------------------------------------------------ lookups


def test_unknown_name_lists_known_names_with_providers_and_the_closest_match():
    register_inner_wrapper("sdpa_qkv", attn_wrapper)
    register_inner_wrapper("flex_hf", attn_wrapper)
    with pytest.raises(UnknownRegistryItemError) as e:
        INNER_WRAPPER_REGISTRY.get_item("sdpa_qvk")
    err = e.value
    assert type(err) is UnknownRegistryItemError
    assert (
        isinstance(err, LookupError)
        and isinstance(err, ValueError)
        and not isinstance(err, KeyError)
    )
    lines = str(err).splitlines()
    assert lines[0] == "unknown inner wrapper 'sdpa_qvk'. Did you mean 'sdpa_qkv'?"
    (known,) = [line for line in lines if line.startswith("Known inner wrappers: ")]
    assert "sdpa_qkv (provider 'user'" in known and "flex_hf (provider 'user'" in known
    assert lines[-1].startswith("Fix:") and "register_inner_wrapper(name, fn)" in lines[-1]
    assert (err.kind, err.name) == ("inner_wrapper", "sdpa_qvk")


def test_subscript_error_is_also_a_keyerror_with_a_readable_str():
    with pytest.raises(KeyError) as e:
        COMPUTE_FACTORY_REGISTRY["qwen2_moe"]
    assert isinstance(e.value, UnknownRegistryItemError)
    assert str(e.value).startswith("unknown compute factory 'qwen2_moe'.")
    assert COMPUTE_FACTORY_REGISTRY.get("qwen2_moe") is None
    assert COMPUTE_FACTORY_REGISTRY.get("qwen2_moe", 7) == 7
    assert "qwen2_moe" not in COMPUTE_FACTORY_REGISTRY


def test_lookup_of_an_unknown_kind():
    with pytest.raises(
        ValueError, match=r"unknown registry kind 'inner_wrappers'\. Did you mean 'inner_wrapper'\?"
    ):
        lookup("inner_wrappers", "x")


def test_empty_registry_message():
    with pytest.raises(UnknownRegistryItemError, match="No router adapters are registered"):
        lookup(RegistryKind.ROUTER_ADAPTER, "topk")


def test_repr_lists_names():
    register_router_adapter("topk", len)
    assert repr(ROUTER_ADAPTER_REGISTRY) == "<router adapter registry: topk>"


# ------------------------------------------------------------------ unregister / reset


def test_unregister_user_items_only():
    item = register_inner_wrapper("temp", attn_wrapper)
    assert unregister("inner_wrapper", "temp") is item
    assert "temp" not in INNER_WRAPPER_REGISTRY
    register_inner_wrapper("temp", attn_wrapper)  # the name is free again
    with pytest.raises(ProtectedRegistryItemError) as e:
        unregister("template", "role.embed")
    assert "plugin 'builtin' (hp-core" in str(e.value).splitlines()[0]
    assert "role.embed" in TEMPLATE_REGISTRY
    with pytest.raises(UnknownRegistryItemError):
        unregister("inner_wrapper", "never_registered")


def test_reset_plugins_forgets_user_registrations():
    register_router_adapter("gone", len)
    reset_plugins()
    assert "gone" not in ROUTER_ADAPTER_REGISTRY


# ------------------------------------------------------------------ register_plugin


class ExamplePlugin:
    HP_PLUGIN_API = 2

    @hookimpl
    def hp_register_inner_wrappers(self, register):
        register("example_attn", attn_wrapper, needs_cp=True, region_dispatch=False)

    @hookimpl
    def hp_register_router_adapters(self, register):
        register("example_router", len)


def test_register_plugin_by_hand():
    info = register_plugin(ExamplePlugin(), name="example")
    assert (info.name, info.status, info.items, info.distribution) == ("example", "loaded", 2, None)
    assert INNER_WRAPPER_REGISTRY["example_attn"].provider == "example"
    assert plugin_report()[-1] == info
    assert "tests" not in plugin_packages()  # only a module's package is trusted


def test_register_plugin_module_trusts_its_package():
    module = types.ModuleType("handmade_pkg.plugin")
    module.HP_PLUGIN_API = 2
    module.hp_register_router_adapters = ExamplePlugin().hp_register_router_adapters
    assert register_plugin(module, name="handmade").items == 1
    assert "handmade_pkg" in plugin_packages()


def test_register_plugin_failure_raises_and_changes_nothing():
    class Broken:
        HP_PLUGIN_API = 2

        @hookimpl
        def hp_register_inner_wrappers(self, register):
            register("half_done", attn_wrapper)
            register("bad", plain)

    before, report = snapshot(), plugin_report()
    with pytest.raises(PluginLoadError) as e:
        register_plugin(Broken(), name="broken")
    assert "plugin 'broken'" in str(e.value) and "@inner_wrapper" in str(e.value)
    assert [f.name for f in e.value.failures] == ["broken"]
    assert snapshot() == before and plugin_report() == report


@pytest.mark.parametrize("name", ["builtin", "user"])
def test_register_plugin_reserved_names(name):
    with pytest.raises(PluginLoadError, match=f"plugin name '{name}' is already used by"):
        register_plugin(ExamplePlugin(), name=name)


def test_register_plugin_name_taken():
    register_plugin(ExamplePlugin(), name="taken")
    with pytest.raises(
        PluginLoadError, match="plugin name 'taken' is already used by plugin 'taken'"
    ):
        register_plugin(ExamplePlugin(), name="taken")


def test_registry_access_during_loading_is_refused(monkeypatch):
    monkeypatch.setattr(_state.LOADING, "active", True)
    reset_plugins()
    with pytest.raises(RuntimeError, match=r"^a plugin accessed the hp plugin registries while"):
        len(INNER_WRAPPER_REGISTRY)


def test_register_plugin_same_object_twice_under_another_name():
    plugin = ExamplePlugin()
    register_plugin(plugin, name="once")
    with pytest.raises(PluginLoadError, match="cannot register the plugin object"):
        register_plugin(plugin, name="twice")


def test_unknown_name_mentions_plugins_that_did_not_load(monkeypatch):
    monkeypatch.delenv("HP_DISABLE_PLUGIN_AUTOLOAD")
    monkeypatch.setenv("HP_PLUGINS", "moe")
    reset_plugins()
    with pytest.raises(UnknownRegistryItemError) as e:
        lookup("inner_wrapper", "sdpa_qkv")
    (line,) = [t for t in str(e.value).splitlines() if t.startswith("Not loaded: plugin(s) ")]
    assert "'cp' (disabled)" in line and "'moe'" not in line
    assert "run `hp plugins` for details" in str(e.value)


def test_kind_names():
    assert INNER_WRAPPER_REGISTRY.kind is RegistryKind.INNER_WRAPPER
    assert str(RegistryKind.COMPUTE_FACTORY) == "compute_factory"
    assert RegistryKind.COMPUTE_FACTORY.label == "compute factory"
