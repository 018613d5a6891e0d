"""hp-plugin-moe is a real distribution that hp discovers through its `moe` entry point."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from hp_core.plugins import plugin_report, registered_items, reset_plugins

HERE = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    for var in ("HP_DISABLE_PLUGIN_AUTOLOAD", "HP_PLUGINS", "HP_PLUGINS_STRICT"):
        monkeypatch.delenv(var, raising=False)
    reset_plugins()
    yield
    reset_plugins()


def test_entry_point_metadata():
    dist = importlib.metadata.distribution("hp-plugin-moe")
    (ep,) = [ep for ep in dist.entry_points if ep.group == "hp_core"]
    assert (ep.name, ep.value) == ("moe", "hp_plugin_moe.plugin")
    assert dist.version == "0.1.0"


def test_depends_on_hp_core_only():
    from packaging.requirements import Requirement

    (req,) = [Requirement(r) for r in importlib.metadata.requires("hp-plugin-moe")]
    assert req.name == "hp-core" and importlib.metadata.version("hp-core") in req.specifier, req


def test_discovered_and_loaded_with_provenance(monkeypatch):
    import hp_plugin_moe.plugin

    monkeypatch.setenv("HP_PLUGINS", "moe")
    (row,) = [r for r in plugin_report() if r.name == "moe"]
    assert (row.distribution, row.version, row.status, row.error) == (
        "hp-plugin-moe",
        "0.1.0",
        "loaded",
        None,
    )
    assert Path(hp_plugin_moe.plugin.__file__) == HERE / "src" / "hp_plugin_moe" / "plugin.py"
    mine = [item for item in registered_items() if item.provider == "moe"]
    assert row.items == len(mine) == 7
    assert {item.kind.value for item in mine} == {"compute_factory", "router_adapter"}
    assert all(item.distribution == "hp-plugin-moe" for item in mine)
    factories = {
        item.name: item.meta["architectures"]
        for item in mine
        if item.kind.value == "compute_factory"
    }
    assert factories == {
        "qwen2moe": ("Qwen2MoeForCausalLM",),
        "mixtral": ("MixtralForCausalLM",),
        "routed_only": ("Qwen3MoeForCausalLM", "OlmoeForCausalLM"),
        "deepseekv3": ("DeepseekV3ForCausalLM",),
    }


def test_disabled_plugin_registers_nothing_but_its_factories_still_import(monkeypatch):
    """With the plugin not loaded its names are unknown to hp, yet the functions stay usable."""
    import hp_plugin_moe
    from hp_core.plugins import suggest_compute_factory

    monkeypatch.setenv("HP_PLUGINS", "")
    assert suggest_compute_factory("Qwen2MoeForCausalLM") is None
    assert not [item for item in registered_items() if item.provider == "moe"]
    assert hp_plugin_moe.qwen2moe._injection_meta.kind == "local_compute"
