"""hp-plugin-cp passes hp's plugin conformance suite (``docs/conformance.md``).

Entry point, hp-core range, plugin API, provenance, declared items, isolation and the
public surface come from :class:`~hp_core.testing.conformance.PluginConformance`. The
equivalence case is a tiny Llama on cp=2 with the plugin's ``sdpa_hf`` attention: the
batch is split along the sequence and the loss reduced over cp by the plugin's public
hooks for the check (``hp_plugin_cp.equivalence``); ``test_cp_distributed.py`` covers the
other wrappers and meshes.
"""

from __future__ import annotations

from hp_core.testing import EquivalenceCase
from hp_core.testing.conformance import PluginConformance
from hp_plugin_cp import HF_CP_OVERRIDES, cp_global_loss, cp_shard_batch


class TestConformance(PluginConformance):
    distribution = "hp-plugin-cp"
    entry_point = "cp"
    package = "hp_plugin_cp"
    equivalence = (
        EquivalenceCase.family(
            "llama",
            "cp=2",
            overrides=HF_CP_OVERRIDES,
            shard_batch=cp_shard_batch,
            after_apply=cp_global_loss,
            steps=1,
        ),
    )
