"""hp-plugin-cp passes hp's plugin conformance suite (``docs/conformance.md``).

Entry point, hp-core range, plugin API, provenance, declared items, isolation and the
public surface come from :class:`~hp_core.testing.conformance.PluginConformance`. Its
equivalence is not run here: a cp case needs the batch split along the sequence and the
loss reduced over cp (``shard_batch_for_cp``, ``enable_cp_loss``), which the one-call check
does not do; ``test_cp_distributed.py`` runs those comparisons on real gloo ranks.
"""

from __future__ import annotations

from hp_core.testing.conformance import PluginConformance


class TestConformance(PluginConformance):
    distribution = "hp-plugin-cp"
    entry_point = "cp"
    package = "hp_plugin_cp"
    equivalence = ()
    no_equivalence_reason = (
        "cp=2 needs the sequence-split batch and the cp loss reduction the one-call check "
        "does not apply; hp_plugin_cp/tests/test_cp_distributed.py compares sdpa_hf, sdpa_qkv "
        "and flex against one device (loss, logits, every gradient, both modes) on gloo ranks"
    )
