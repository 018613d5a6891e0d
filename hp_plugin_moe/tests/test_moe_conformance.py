"""hp-plugin-moe passes hp's plugin conformance suite (``docs/conformance.md``), with a tiny
Qwen2-MoE at ep=2 through the one-call equivalence check; and what the suite cannot know:
which architecture each compute factory claims, and that the factories stay importable
with the plugin left out."""

from __future__ import annotations

import pytest

import hp_plugin_moe
from hp_core.plugins import ENV_PLUGINS, registered_items, reset_plugins, suggest_compute_factory
from hp_core.testing.conformance import EquivalenceCase, PluginConformance


class TestConformance(PluginConformance):
    distribution = "hp-plugin-moe"
    entry_point = "moe"
    package = "hp_plugin_moe"
    # ep=2 with zero config: the planner picks qwen2moe for Qwen2MoeForCausalLM.
    equivalence = [EquivalenceCase.family("qwen2_moe", "tp=2", plan_kwargs={"ep_size": 2})]


@pytest.fixture
def _fresh(monkeypatch):
    monkeypatch.delenv(ENV_PLUGINS, raising=False)
    reset_plugins()
    yield monkeypatch
    reset_plugins()


def test_each_factory_claims_its_architectures(_fresh):
    factories = {
        item.name: item.meta["architectures"]
        for item in registered_items("compute_factory")
        if item.provider == "moe"
    }
    assert factories == {
        "qwen2moe": ("Qwen2MoeForCausalLM",),
        "mixtral": ("MixtralForCausalLM",),
        "routed_only": ("Qwen3MoeForCausalLM", "OlmoeForCausalLM"),
        "deepseekv3": ("DeepseekV3ForCausalLM",),
    }


def test_left_out_its_names_are_unknown_but_its_factories_still_import(_fresh):
    _fresh.setenv(ENV_PLUGINS, "")
    assert suggest_compute_factory("Qwen2MoeForCausalLM") is None
    assert hp_plugin_moe.qwen2moe._injection_meta.kind == "local_compute"
