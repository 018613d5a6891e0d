"""The versioned plugin contract: a plugin declares HP_PLUGIN_API; other versions are refused."""

from __future__ import annotations

import pytest

import hp_core
from hp_core.plugins import (
    PLUGIN_API_VERSION,
    TEMPLATE_REGISTRY,
    PluginLoadError,
    load_plugins,
    plugin_report,
    register_plugin,
)

pytestmark = pytest.mark.usefixtures("plugin_env")

_BODY = """
from hp_core import Role, RoleRule

@hookimpl
def hp_register_templates(register):
    register(RoleRule("{name}.rule", r"(^|\\.)wqkv\\.weight$", Role.FUSED_QKV, ("XForCausalLM",)))
"""


def _versioned(fakes, name: str, declaration: str) -> None:
    """A fake plugin whose module declares ``declaration`` (replacing the header's line)."""
    module = fakes.plugin(name, _BODY.format(name=name), dist=f"fake-{name}", version="1.4")
    path = fakes.root / f"{module}.py"
    path.write_text(path.read_text().replace("HP_PLUGIN_API = 2\n", declaration))


def _rows():
    return {row.name: row for row in plugin_report()}


def test_the_version_is_public():
    assert PLUGIN_API_VERSION == 2
    assert hp_core.PLUGIN_API_VERSION == 2 and "PLUGIN_API_VERSION" in hp_core.__all__


def test_first_party_plugins_declare_the_version():
    import hp_plugin_cp.plugin
    import hp_plugin_moe.plugin
    import hp_plugin_phi3.plugin

    for module in (hp_plugin_cp.plugin, hp_plugin_moe.plugin, hp_plugin_phi3.plugin):
        assert module.HP_PLUGIN_API == PLUGIN_API_VERSION, module.__name__
    assert _rows()["builtin"].status == "builtin"


def test_a_plugin_declaring_2_loads(fakes):
    _versioned(fakes, "vtwo", "HP_PLUGIN_API = 2\n")
    assert _rows()["vtwo"].status == "loaded"
    assert "vtwo.rule" in TEMPLATE_REGISTRY


def test_a_plugin_declaring_1_is_refused_naming_both_versions(fakes):
    _versioned(fakes, "vone", "HP_PLUGIN_API = 1\n")
    row = _rows()["vone"]
    assert row.status == "failed" and row.items == 0
    assert row.error.startswith(
        "plugin 'vone' (fake-vone 1.4) declares HP_PLUGIN_API = 1, but this hp-core"
    )
    assert "supports plugin API 2 only." in row.error
    assert "Fix: install a release of the plugin built for hp plugin API 2" in row.error
    assert "pip install -U fake-vone" in row.error
    assert "vone.rule" not in TEMPLATE_REGISTRY


@pytest.mark.parametrize("declaration", ["", "HP_PLUGIN_API = '2'\n", "HP_PLUGIN_API = True\n"])
def test_a_plugin_declaring_none_or_a_non_int_is_refused(fakes, declaration):
    _versioned(fakes, "vnone", declaration)
    row = _rows()["vnone"]
    assert row.status == "failed"
    if declaration:
        assert "declares HP_PLUGIN_API = " in row.error
    else:
        assert row.error.startswith(
            "plugin 'vnone' (fake-vnone 1.4) declares no plugin API version "
            "(no HP_PLUGIN_API attribute), but this hp-core"
        )
    assert "supports plugin API 2 only." in row.error


def test_the_version_is_checked_before_any_hook_runs(fakes):
    module = fakes.plugin("vhook", "@hookimpl\ndef hp_register_templates(register):\n    1 / 0\n")
    path = fakes.root / f"{module}.py"
    path.write_text(path.read_text().replace("HP_PLUGIN_API = 2\n", "HP_PLUGIN_API = 3\n"))
    error = _rows()["vhook"].error
    assert "declares HP_PLUGIN_API = 3" in error and "ZeroDivisionError" not in error


def test_strict_mode_raises(fakes):
    _versioned(fakes, "vstrict", "HP_PLUGIN_API = 1\n")
    with pytest.raises(PluginLoadError, match=r"plugin 'vstrict' \(fake-vstrict 1.4\)") as e:
        load_plugins(strict=True)
    assert "declares HP_PLUGIN_API = 1" in str(e.value)
    assert [f.name for f in e.value.failures] == ["vstrict"]


def test_register_plugin_refuses_an_undeclared_plugin():
    class Undeclared:
        @hp_core.hookimpl
        def hp_register_router_adapters(self, register):
            register("undeclared_router", len)

    with pytest.raises(PluginLoadError, match="declares no plugin API version"):
        register_plugin(Undeclared(), name="undeclared")
    assert "undeclared" not in _rows()
