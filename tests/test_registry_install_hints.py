"""An unknown first-party item name says which distribution provides it
(hp_core.plugins._registry)."""

from __future__ import annotations

import pytest

from hp_core.plugins import RegistryKind, UnknownRegistryItemError, lookup, reset_plugins
from hp_core.plugins._registry import WELL_KNOWN_ITEMS
from tests._plugin_fakes import clean_plugin_env


@pytest.fixture(autouse=True)
def _no_plugins(monkeypatch):
    clean_plugin_env(monkeypatch)
    monkeypatch.setenv("HP_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_plugins()
    yield
    reset_plugins()


@pytest.mark.parametrize(
    ("kind", "name", "dist"),
    [
        ("inner_wrapper", "sdpa_hf", "hp-plugin-cp"),
        ("inner_wrapper", "flex_qkv", "hp-plugin-cp"),
        ("compute_factory", "mixtral", "hp-plugin-moe"),
    ],
)
def test_missing_first_party_item_names_its_distribution(kind, name, dist):
    with pytest.raises(UnknownRegistryItemError) as e:
        lookup(kind, name)
    lines = str(e.value).splitlines()
    assert lines[0] == f"unknown {kind.replace('_', ' ')} {name!r}."
    assert (
        lines[1].startswith(f"{name!r} is provided by the distribution {dist}")
        and f"pip install {dist}" in lines[1]
    )


def test_other_names_get_no_install_hint():
    with pytest.raises(UnknownRegistryItemError) as e:
        lookup("inner_wrapper", "my_ring_attention")
    assert "pip install" not in str(e.value)


def test_table_covers_the_four_cp_wrappers():
    cp = {n for n, d in WELL_KNOWN_ITEMS[RegistryKind.INNER_WRAPPER].items() if d == "hp-plugin-cp"}
    assert cp == {"sdpa_qkv", "sdpa_hf", "flex_qkv", "flex_hf"}
