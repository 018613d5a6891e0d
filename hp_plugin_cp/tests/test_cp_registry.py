"""The four CP wrappers reach hp through the plugin hook; without the plugin CP plans fail
clearly."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
import yaml

from hp_core import cli, plan
from hp_core.injection import require_injection_meta
from hp_core.plugins import (
    INNER_WRAPPER_REGISTRY,
    RecordedProvider,
    UnknownRegistryItemError,
    lookup,
    plugin_report,
    reset_plugins,
)
from hp_core.presets import build_model
from hp_plugin_cp import flex_hf, flex_qkv, sdpa_hf, sdpa_qkv

DOC = Path(__file__).resolve().parents[2] / "docs" / "cp.md"
NAMES = {
    "sdpa_qkv": (sdpa_qkv, "qkv"),
    "sdpa_hf": (sdpa_hf, "hf"),
    "flex_qkv": (flex_qkv, "qkv"),
    "flex_hf": (flex_hf, "hf"),
}


def doc_yaml() -> str:
    blocks = re.findall(r"^```yaml\n(.*?)^```", DOC.read_text(), re.MULTILINE | re.DOTALL)
    (block,) = [b for b in blocks if "inner_wrapper: sdpa_hf" in b]
    return block


def test_wrappers_registered_with_requirements_and_provenance(plugins_env):
    for name, (fn, style) in NAMES.items():
        item = lookup("inner_wrapper", name)
        assert item.value is fn
        assert (item.provider, item.distribution) == ("cp", "hp-plugin-cp")
        assert dict(item.meta) == {
            "needs_cp": True,
            "region_dispatch": False,
            "forward_style": style,
        }
        meta = require_injection_meta(fn, "inner_wrapper", source=name)
        assert meta.context == ("target_module", "ctx")
    (row,) = [r for r in plugin_report() if r.name == "cp"]
    assert (row.status, row.items) == ("loaded", 5)  # 4 wrappers + the cp training adapter


def test_hp_plugins_lists_the_wrappers(plugins_env, capsys):
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    for name, (_fn, style) in NAMES.items():
        line = next(line for line in out.splitlines() if f" {name} " in line)
        assert (
            "hp-plugin-cp" in line and f"forward_style={style}" in line and "needs_cp=True" in line
        )


def test_without_the_plugin_the_wrappers_are_gone_and_the_error_says_what_to_install(
    plugins_env, capsys
):
    plugins_env.setenv("HP_PLUGINS", "moe")  # as if only hp-plugin-moe were installed
    reset_plugins()
    assert not set(NAMES) & set(INNER_WRAPPER_REGISTRY)
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "sdpa_hf" not in out
    with pytest.raises(UnknownRegistryItemError) as err:
        lookup("inner_wrapper", "sdpa_hf")
    # Declared in the installed distribution's hp_core.items metadata, its plugin disabled.
    assert "declared by the installed distribution hp-plugin-cp" in str(err.value)
    assert "plugin 'cp' is disabled (not listed in HP_PLUGINS=moe)" in str(err.value)


def test_uninstalled_plugin_disappears_from_hp_plugins(plugins_env, capsys):
    """No entry point at all (what `pip uninstall hp-plugin-cp` leaves): no row, no items."""
    real = importlib.metadata.entry_points

    def without_cp(**kwargs):
        return [ep for ep in real(**kwargs) if getattr(ep.dist, "name", None) != "hp-plugin-cp"]

    plugins_env.setattr(importlib.metadata, "entry_points", without_cp)
    reset_plugins()
    assert "cp" not in [r.name for r in plugin_report()]
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "hp-plugin-cp" not in out and "flex_hf" not in out
    with pytest.raises(UnknownRegistryItemError, match="No installed distribution declares"):
        lookup("inner_wrapper", "flex_qkv")
    # A plan made where it was installed recorded its provider: that is what to install.
    made_with = RecordedProvider("hp-plugin-cp", "0.1.0")
    with pytest.raises(UnknownRegistryItemError, match=r"pip install hp-plugin-cp==0\.1\.0"):
        lookup("inner_wrapper", "flex_qkv", recorded=made_with)
    # and the distribution really is installed, so this was the entry point's doing
    assert importlib.metadata.version("hp-plugin-cp") == "0.1.0"


def test_doc_yaml_block_is_the_override_from_the_issue():
    (entry,) = yaml.safe_load(doc_yaml())
    assert entry == {
        "match": "*.self_attn",
        "when": "cp",
        "inner_target": "self",
        "inner_wrapper": "sdpa_hf",
        "region_dispatch": False,
    }


@pytest.mark.parametrize("mesh", ["cp=2", "cp=2,tp=2"])
def test_doc_yaml_puts_sdpa_hf_on_every_attention(plugins_env, mesh):
    model = build_model("llama", seed=0, device="meta")
    p = plan(model, mesh, overrides=doc_yaml())
    attn = {fqn: s for fqn, s in p.items() if s._needs_cp_attn}
    assert sorted(attn) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for spec in attn.values():
        assert (spec.inner_target, spec.inner_wrapper, spec.region_dispatch) == (
            "self",
            "sdpa_hf",
            False,
        )
        assert spec.in_dst["hidden_states"]["cp"].dim == 1  # the sequence stays sharded on cp
    assert all(not isinstance(s.inner_wrapper, str) for fqn, s in p.items() if fqn not in attn)


def test_doc_yaml_is_skipped_without_cp(plugins_env):
    model = build_model("llama", seed=0, device="meta")
    p = plan(model, "tp=2", overrides=doc_yaml())
    assert all(s.inner_wrapper is None for s in p.modules.values())


def test_doc_python_plan_example_uses_the_same_yaml():
    text = DOC.read_text()
    inline = re.search(r'CP_YAML = """\n(.*?)"""', text, re.DOTALL).group(1)
    assert inline == doc_yaml()
