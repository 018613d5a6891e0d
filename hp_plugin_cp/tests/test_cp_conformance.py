"""hp-plugin-cp passes hp's plugin conformance suite (``docs/conformance.md``).

Entry point, hp-core range, plugin API, provenance, declared items, isolation and the
public surface come from :class:`~hp_core.testing.conformance.PluginConformance`. The
equivalence case is a tiny Llama on cp=2 with the plugin's ``sdpa_hf`` attention: the
batch is split along the sequence by the plugin's training adapter and the loss reduced
over cp (the check's ``shard_batch`` / ``after_apply`` hooks); ``test_cp_distributed.py``
covers the other wrappers and meshes.
"""

from __future__ import annotations

from _cp_rank_tasks import CONFORMANCE_OVERRIDES, conformance_loss, conformance_shard

from hp_core.testing import EquivalenceCase
from hp_core.testing.conformance import PluginConformance


class TestConformance(PluginConformance):
    distribution = "hp-plugin-cp"
    entry_point = "cp"
    package = "hp_plugin_cp"
    equivalence = (
        EquivalenceCase.family(
            "llama",
            "cp=2",
            overrides=CONFORMANCE_OVERRIDES,
            shard_batch=conformance_shard,
            after_apply=conformance_loss,
            steps=1,
        ),
    )
