"""hp-plugin-cp is a real distribution that hp discovers through its `cp` entry point."""

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
    dist = importlib.metadata.distribution("hp-plugin-cp")
    (ep,) = [ep for ep in dist.entry_points if ep.group == "hp_core"]
    assert (ep.name, ep.value) == ("cp", "hp_plugin_cp.plugin")
    assert dist.version == "0.1.0"


def test_depends_on_hp_core_only():
    from packaging.requirements import Requirement

    (req,) = [Requirement(r) for r in importlib.metadata.requires("hp-plugin-cp")]
    assert req.name == "hp-core" and importlib.metadata.version("hp-core") in req.specifier, req


def test_discovered_and_loaded_with_provenance():
    import hp_plugin_cp.plugin

    (row,) = [r for r in plugin_report() if r.name == "cp"]
    assert (row.distribution, row.version, row.status, row.error) == (
        "hp-plugin-cp",
        "0.1.0",
        "loaded",
        None,
    )
    assert Path(hp_plugin_cp.plugin.__file__) == HERE / "src" / "hp_plugin_cp" / "plugin.py"
    mine = [item for item in registered_items() if item.provider == "cp"]
    assert row.items == len(mine)
    assert all(item.distribution == "hp-plugin-cp" for item in mine)
    assert sorted(item.kind.value for item in mine) == ["inner_wrapper"] * 4 + ["training_adapter"]
