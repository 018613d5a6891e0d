"""hp-plugin-bloom passes hp's plugin conformance suite (``docs/conformance.md``), with a tiny
BLOOM at tp=2 (per-rank ALiBi heads, residuals added once) through the one-call
equivalence check; without the plugin hp refuses BLOOM on tp, so the case needs it."""

from __future__ import annotations

from hp_core.testing.conformance import EquivalenceCase, PluginConformance


class TestConformance(PluginConformance):
    distribution = "hp-plugin-bloom"
    entry_point = "bloom"
    package = "hp_plugin_bloom"
    equivalence = [EquivalenceCase.family("bloom", "tp=2")]
