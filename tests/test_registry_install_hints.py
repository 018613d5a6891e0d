"""An unknown first-party item name says which installed distribution declares it, from
its ``hp_core.items`` metadata (hp_core.plugins._declared, hp_core.plugins._registry).

These read the installed distributions' metadata: the shared environment's hp-plugin-cp and
hp-plugin-moe must be installed from a checkout whose pyproject declares the items.
"""

from __future__ import annotations

import pytest

from hp_core.plugins import UnknownRegistryItemError, declared_providers, lookup, reset_plugins
from tests._plugin_fakes import clean_plugin_env


@pytest.fixture(autouse=True)
def _no_plugins(monkeypatch):
    clean_plugin_env(monkeypatch)
    monkeypatch.setenv("HP_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_plugins()
    yield
    reset_plugins()


@pytest.mark.parametrize(
    ("kind", "name", "dist", "entry_point"),
    [
        ("inner_wrapper", "sdpa_hf", "hp-plugin-cp", "cp"),
        ("inner_wrapper", "flex_qkv", "hp-plugin-cp", "cp"),
        ("compute_factory", "mixtral", "hp-plugin-moe", "moe"),
    ],
)
def test_missing_first_party_item_names_its_distribution(kind, name, dist, entry_point):
    (declared,) = declared_providers(kind, name)
    assert (declared.distribution, declared.entry_point, declared.status) == (
        dist,
        entry_point,
        "disabled",
    )
    with pytest.raises(UnknownRegistryItemError) as e:
        lookup(kind, name)
    lines = str(e.value).splitlines()
    assert lines[0] == f"unknown {kind.replace('_', ' ')} {name!r}."
    assert lines[1].startswith(f"{name!r} is declared by the installed distribution {dist} ")
    assert f"its plugin {entry_point!r} is disabled (HP_DISABLE_PLUGIN_AUTOLOAD=1)" in lines[1]
    assert lines[-1].startswith(f"Fix: load plugin {entry_point!r} (add it to HP_PLUGINS")
    assert "pip install" not in str(e.value)  # it is installed


def test_other_names_get_no_install_hint():
    assert declared_providers("inner_wrapper", "my_ring_attention") == []
    with pytest.raises(UnknownRegistryItemError) as e:
        lookup("inner_wrapper", "my_ring_attention")
    assert "No installed distribution declares the inner wrapper 'my_ring_attention'" in str(
        e.value
    )
    assert "pip install" not in str(e.value)
