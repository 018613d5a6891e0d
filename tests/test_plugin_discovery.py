"""Entry-point discovery: real plugins, fake distributions, failures, env switches, strict mode."""

from __future__ import annotations

import importlib.metadata
import warnings
from pathlib import Path

import pytest

from hp_core.plugins import (
    INNER_WRAPPER_REGISTRY,
    ROUTER_ADAPTER_REGISTRY,
    HpPluginWarning,
    PluginInfo,
    PluginLoadError,
    _discovery,
    load_plugins,
    plugin_packages,
    plugin_report,
    plugin_warnings,
    reset_plugins,
)

ROOT = Path(__file__).resolve().parent.parent

GOOD = """
@hookimpl
def hp_register_inner_wrappers(register):
    register("{name}", good_wrapper, needs_cp=True, region_dispatch=False, forward_style="qkv")
"""


pytestmark = pytest.mark.usefixtures("plugin_env")


def report() -> dict[str, PluginInfo]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HpPluginWarning)
        return {p.name: p for p in plugin_report()}


def assert_real_plugins_loaded(rows: dict[str, PluginInfo]) -> None:
    for name, dist in (
        ("cp", "hp-plugin-cp"),
        ("moe", "hp-plugin-moe"),
        ("phi3", "hp-plugin-phi3"),
        ("bloom", "hp-plugin-bloom"),
    ):
        assert name in rows, f"{dist} is not installed: run pip install -e for it (see Makefile)"
        assert (rows[name].distribution, rows[name].version, rows[name].status) == (
            dist,
            "0.1.0",
            "loaded",
        )


# ------------------------------------------------------------------ real plugins


def test_real_first_party_plugins_are_discovered_through_their_entry_points():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="hp_core")}
    assert eps["cp"].value == "hp_plugin_cp.plugin" and eps["cp"].dist.name == "hp-plugin-cp"
    assert eps["moe"].value == "hp_plugin_moe.plugin" and eps["moe"].dist.name == "hp-plugin-moe"
    rows = report()
    assert next(iter(rows)) == "builtin"
    assert_real_plugins_loaded(rows)
    assert {"hp_core", "hp_plugin_cp", "hp_plugin_moe", "hp_plugin_phi3", "hp_plugin_bloom"} <= (
        plugin_packages()
    )


def test_installed_plugins_import_from_their_src_layout():
    import hp_plugin_cp
    import hp_plugin_moe

    assert Path(hp_plugin_cp.__file__) == ROOT / "hp_plugin_cp/src/hp_plugin_cp/__init__.py"
    assert Path(hp_plugin_moe.__file__) == ROOT / "hp_plugin_moe/src/hp_plugin_moe/__init__.py"


# ------------------------------------------------------------------ appear / disappear


def test_fake_plugin_appears_and_disappears_with_its_metadata(fakes):
    module = fakes.plugin("fakeplug", GOOD.format(name="fake_attn"), dist="fakeplug", version="0.1")
    rows = report()
    assert rows["fakeplug"] == PluginInfo("fakeplug", "fakeplug", "0.1", "loaded", items=1)
    item = INNER_WRAPPER_REGISTRY["fake_attn"]
    assert (item.provider, item.distribution, item.version) == ("fakeplug", "fakeplug", "0.1")
    assert dict(item.meta) == {"needs_cp": True, "region_dispatch": False, "forward_style": "qkv"}
    assert module in plugin_packages()
    assert_real_plugins_loaded(rows)

    fakes.hide()
    assert "fakeplug" not in report()
    assert "fake_attn" not in INNER_WRAPPER_REGISTRY
    assert module not in plugin_packages()


def test_plugin_packages_come_from_record_and_top_level(fakes):
    fakes.add_distribution(
        "fake-packaged",
        {"packaged": "fakepkg_entry.plugin"},
        modules={"fakepkg_entry.plugin": "HP_PLUGIN_API = 2\n", "fakepkg_entry.__init__": ""},
        record=[
            "fakepkg_other/__init__.py",
            "fake_single_module.py",
            "__editable__.fake_packaged-0.1.pth",
            "fake_packaged-0.1.dist-info/METADATA",
            "../../bin/fake-script",
        ],
    )
    (next(fakes.root.glob("fake_packaged-*.dist-info")) / "top_level.txt").write_text(
        "fakepkg_top\n"
    )
    reset_plugins()
    assert report()["packaged"].status == "loaded"
    packages = plugin_packages()
    assert {"fakepkg_entry", "fakepkg_other", "fake_single_module", "fakepkg_top"} <= packages
    assert not {"..", "__editable__", "fake_packaged-0.1.dist-info"} & packages


# ------------------------------------------------------------------ failures


def failed(rows: dict[str, PluginInfo], name: str) -> PluginInfo:
    info = rows[name]
    assert info.status == "failed", info
    assert info.items == 0
    assert info.error
    return info


def assert_strict_raises(name: str, dist: str, fragment: str) -> None:
    with pytest.raises(PluginLoadError) as e:
        load_plugins(strict=True)
    msg = str(e.value)
    assert f"plugin '{name}' ({dist} 0.1)" in msg and fragment in msg
    assert name in [f.name for f in e.value.failures]


def test_import_error_is_reported_and_does_not_take_down_the_others(fakes):
    fakes.add_distribution("fake-broken-import", {"broken": "fake_missing_module_xyz"})
    fakes.plugin("healthy", GOOD.format(name="healthy_attn"))
    rows = report()
    info = failed(rows, "broken")
    assert (info.distribution, info.version) == ("fake-broken-import", "0.1")
    assert (
        "importing entry point 'broken = fake_missing_module_xyz' raised ModuleNotFoundError"
        in info.error
    )
    assert rows["healthy"].status == "loaded" and "healthy_attn" in INNER_WRAPPER_REGISTRY
    assert_real_plugins_loaded(rows)
    assert_strict_raises("broken", "fake-broken-import", "ModuleNotFoundError")


def test_raising_hook_is_reported(fakes):
    fakes.plugin(
        "raiser",
        """
        @hookimpl
        def hp_register_router_adapters(register):
            register("early", len)
            raise RuntimeError("boom in hook")
        """,
    )
    info = failed(report(), "raiser")
    assert info.error == "hook hp_register_router_adapters raised RuntimeError: boom in hook"
    assert "early" not in ROUTER_ADAPTER_REGISTRY  # all-or-nothing
    assert_strict_raises("raiser", "fake-raiser", "boom in hook")


def test_misspelled_hook_names_the_closest_real_hook(fakes):
    fakes.plugin(
        "typo",
        """
        @hookimpl
        def hp_register_inner_wrapper(register):
            register("never", good_wrapper)
        """,
    )
    info = failed(report(), "typo")
    assert info.error.splitlines()[0] == (
        "implements unknown hook 'hp_register_inner_wrapper' (did you mean "
        "'hp_register_inner_wrappers'?)."
    )
    assert "never" not in INNER_WRAPPER_REGISTRY
    assert report()["cp"].status == "loaded"
    assert_strict_raises("typo", "fake-typo", "hp_register_inner_wrappers")


def test_duplicate_name_across_plugins_names_both(fakes):
    fakes.plugin("dupa", GOOD.format(name="shared_name"), dist="fake-dup-a")
    fakes.plugin(
        "dupb",
        """
        @hookimpl
        def hp_register_inner_wrappers(register):
            register("unique_b", good_wrapper)
            register("shared_name", good_wrapper)
        """,
        dist="fake-dup-b",
    )
    rows = report()
    assert rows["dupa"].status == "loaded"
    info = failed(rows, "dupb")
    assert info.error.splitlines()[0] == (
        "plugin 'dupb' (fake-dup-b 0.1): inner wrapper 'shared_name' is already registered by "
        "plugin 'dupa' (fake-dup-a 0.1)."
    )
    assert INNER_WRAPPER_REGISTRY["shared_name"].provider == "dupa"
    assert "unique_b" not in INNER_WRAPPER_REGISTRY
    assert_strict_raises("dupb", "fake-dup-b", "fake-dup-a")


def test_name_registered_twice_by_one_plugin(fakes):
    fakes.plugin(
        "twice",
        """
        @hookimpl
        def hp_register_router_adapters(register):
            register("again", len)
            register("again", len)
        """,
    )
    assert (
        "router adapter 'again' is registered twice by this plugin"
        in failed(report(), "twice").error
    )


def test_undecorated_function_fails_the_plugin_atomically(fakes):
    fakes.plugin(
        "undecorated",
        """
        @hookimpl
        def hp_register_inner_wrappers(register):
            register("valid_first", good_wrapper)
            register("naked", undecorated)
        """,
    )
    info = failed(report(), "undecorated")
    assert info.error.startswith(
        "hp_register_inner_wrappers registered an invalid item: InjectionDefinitionError"
    )
    assert "is not decorated with @inner_wrapper" in info.error
    assert "valid_first" not in INNER_WRAPPER_REGISTRY
    assert_strict_raises("undecorated", "fake-undecorated", "@inner_wrapper")


def test_bad_name_from_a_plugin(fakes):
    fakes.plugin(
        "badname",
        """
        @hookimpl
        def hp_register_compute_factories(register):
            register("pkg.factory", good_factory)
        """,
    )
    error = failed(report(), "badname").error
    assert "plugin 'badname' (fake-badname 0.1), compute factory 'pkg.factory'" in error
    assert "invalid compute factory name" in error


def test_hookimpl_with_a_bad_signature(fakes):
    fakes.plugin(
        "badsig",
        """
        @hookimpl
        def hp_register_templates(register, extra):
            pass
        """,
    )
    error = failed(report(), "badsig").error
    assert error.startswith("invalid hook implementation:") and "extra" in error


def test_hook_wrappers_are_refused(fakes):
    fakes.plugin(
        "wrapper",
        """
        @hookimpl(wrapper=True)
        def hp_register_templates(register):
            return (yield)
        """,
    )
    assert (
        "hook hp_register_templates is declared as a wrapper" in failed(report(), "wrapper").error
    )


def test_hook_without_the_register_argument_is_called(fakes):
    fakes.plugin(
        "noargs",
        """
        CALLED = []

        @hookimpl
        def hp_register_templates():
            CALLED.append(1)
        """,
    )
    assert report()["noargs"].status == "loaded"


def test_entry_point_name_clash_with_an_installed_plugin(fakes):
    fakes.plugin("cp", GOOD.format(name="impostor"), dist="fake-cp")
    rows = plugin_report()
    cps = [p for p in rows if p.name == "cp"]
    # The fake is earlier on sys.path, so it wins, as an import would.
    assert [(p.distribution, p.status) for p in cps] == [
        ("fake-cp", "loaded"),
        ("hp-plugin-cp", "failed"),
    ]
    assert cps[1].error.startswith("plugin name 'cp' is already used by plugin 'cp' (fake-cp 0.1).")
    assert INNER_WRAPPER_REGISTRY["impostor"].distribution == "fake-cp"


def test_entry_point_named_builtin_is_refused(fakes):
    fakes.plugin("builtin", GOOD.format(name="sneaky"), dist="fake-builtin")
    rows = plugin_report()
    assert [p.status for p in rows if p.name == "builtin"] == ["builtin", "failed"]


def test_plugin_that_reads_registries_at_import_fails_cleanly(fakes):
    fakes.plugin(
        "eager",
        """
        from hp_core.plugins import INNER_WRAPPER_REGISTRY
        len(INNER_WRAPPER_REGISTRY)
        """,
    )
    error = failed(report(), "eager").error
    assert (
        "plugin 'eager' accessed the hp plugin registries while plugins are being loaded" in error
    )
    assert report()["cp"].status == "loaded"


def test_strict_env_makes_registry_access_raise(fakes, monkeypatch):
    fakes.add_distribution("fake-broken-import", {"broken": "fake_missing_module_xyz"})
    monkeypatch.setenv("HP_PLUGINS_STRICT", "1")
    with pytest.raises(PluginLoadError, match=r"plugin 'broken' \(fake-broken-import 0\.1\)"):
        len(INNER_WRAPPER_REGISTRY)
    with pytest.raises(PluginLoadError):  # every access, not only the first
        len(INNER_WRAPPER_REGISTRY)
    assert failed(report(), "broken")  # the diagnostic report never raises
    monkeypatch.delenv("HP_PLUGINS_STRICT")
    assert len(INNER_WRAPPER_REGISTRY) >= 0


def test_strict_load_without_failures_returns_the_report():
    rows = load_plugins(strict=True)
    assert [r.name for r in rows][:1] == ["builtin"]
    assert rows == plugin_report()


# ------------------------------------------------------------------ env switches


def test_disable_autoload_keeps_only_the_builtin(fakes, monkeypatch):
    fakes.plugin("fakeplug", GOOD.format(name="fake_attn"))
    monkeypatch.setenv("HP_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_plugins()
    rows = report()
    assert rows["builtin"].status == "builtin"
    assert {p.status for n, p in rows.items() if n != "builtin"} == {"disabled"}
    assert rows["cp"].note == "HP_DISABLE_PLUGIN_AUTOLOAD=1"
    assert rows["cp"].distribution == "hp-plugin-cp"
    assert "fake_attn" not in INNER_WRAPPER_REGISTRY
    assert plugin_packages() == frozenset({"hp_core"})


@pytest.mark.parametrize("value", ["0", "", "false"])
def test_disable_autoload_falsy_values(monkeypatch, value):
    monkeypatch.setenv("HP_DISABLE_PLUGIN_AUTOLOAD", value)
    assert report()["cp"].status == "loaded"


def test_hp_plugins_selects_entry_point_names(fakes, monkeypatch):
    fakes.plugin("fakeplug", GOOD.format(name="fake_attn"))
    monkeypatch.setenv("HP_PLUGINS", " cp , fakeplug ")
    reset_plugins()
    rows = report()
    assert rows["cp"].status == "loaded" and rows["fakeplug"].status == "loaded"
    assert rows["moe"].status == "disabled"
    assert rows["moe"].note == "not listed in HP_PLUGINS= cp , fakeplug "
    assert "fake_attn" in INNER_WRAPPER_REGISTRY
    assert "hp_plugin_moe" not in plugin_packages()


def test_hp_plugins_empty_loads_none(monkeypatch):
    monkeypatch.setenv("HP_PLUGINS", "")
    rows = report()
    assert {p.status for n, p in rows.items() if n != "builtin"} == {"disabled"}


def test_unknown_name_in_hp_plugins_is_a_warning_with_the_close_match(monkeypatch):
    monkeypatch.setenv("HP_PLUGINS", "cpp,moe,builtin")
    with pytest.warns(HpPluginWarning, match="HP_PLUGINS names plugin 'cpp'.*Did you mean 'cp'\\?"):
        rows = {p.name: p for p in plugin_report()}
    assert rows["moe"].status == "loaded" and rows["cp"].status == "disabled"
    (warning,) = plugin_warnings()
    installed = sorted({ep.name for ep in importlib.metadata.entry_points(group="hp_core")})
    assert f"Installed plugins: {', '.join(installed)}" in warning
    with pytest.raises(PluginLoadError, match="'cpp'"):
        load_plugins(strict=True)


def test_entry_point_without_a_distribution_contributes_its_module_package():
    ep = importlib.metadata.EntryPoint(name="loose", value="loose_pkg.plugin:obj", group="hp_core")
    assert _discovery.top_level_packages(ep) == {"loose_pkg"}
    assert (_discovery.dist_name(ep), _discovery.dist_version(ep)) == (None, None)


def test_hook_that_returns_items_instead_of_registering_them(fakes):
    fakes.plugin(
        "returner",
        """
        @hookimpl
        def hp_register_router_adapters(register):
            return [("topk", len)]
        """,
    )
    error = failed(report(), "returner").error
    assert error.startswith("hook hp_register_router_adapters returned list instead of None.")
    assert "call register(item)" in error


def test_strict_message_names_the_culprits_first(fakes):
    fakes.add_distribution("fake-broken-import", {"broken": "fake_missing_module_xyz"})
    with pytest.raises(PluginLoadError) as e:
        load_plugins(strict=True)
    lines = str(e.value).splitlines()
    assert (
        lines[0]
        == "hp plugin(s) failed to load (strict mode): plugin 'broken' (fake-broken-import 0.1)"
    )
    assert lines[-1].startswith("Fix:")
