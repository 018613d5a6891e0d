"""hp-plugin-phi3 passes hp's plugin conformance suite (``docs/conformance.md``), with a tiny
Phi-3 at tp=2 (fused qkv_proj and gate_up_proj) through the one-call equivalence check."""

from __future__ import annotations

from hp_core.testing.conformance import EquivalenceCase, PluginConformance


class TestConformance(PluginConformance):
    distribution = "hp-plugin-phi3"
    entry_point = "phi3"
    package = "hp_plugin_phi3"
    equivalence = [EquivalenceCase.family("phi3", "tp=2")]
