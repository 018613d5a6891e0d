"""Gemma, Gemma-2 and Gemma-3 at tp=2 match one device with loss parallel on and off (issue 14,
item 7).

Their scaled embedding, ``1 + weight`` norms and (Gemma-2) attention and final-logit
soft-caps — set small enough to bend the tiny model's values (``tests/test_family_features``
checks that they do) — are planned and matched: loss, logits and every gradient over 2
AdamW steps, production and validate, sequence parallel on and off. Under loss parallel the
final soft-cap runs on each rank's vocab shard (it is elementwise) before the vocab-parallel
cross-entropy, so the result is exact, not refused. Negative controls: a sharded copy that
loses the final soft-cap or the embedding scale is caught.
"""

from __future__ import annotations

import pytest

from hp_core.testing import get_world
from tests import dist_tasks_gemma as tasks

pytestmark = pytest.mark.distributed
TOL = 1e-5
VOCAB = 128


def _matched(r: dict, loss_parallel: bool) -> None:
    assert "refused" not in r, r
    bad = {k: v for k, v in r["excess"].items() if not v <= TOL}
    assert not bad, f"mismatches above {TOL}: {bad}"
    assert r["n_grads"] > 0 and not any(r["unmoved"].values()), r["unmoved"]
    assert r["collectives"] == 0, "the verifier issued a collective"
    # Loss parallel really kept the logits vocab-sharded (and gathered them otherwise).
    assert r["local_vocab"] == (VOCAB // 2 if loss_parallel else VOCAB)


@pytest.mark.parametrize("loss_parallel", [True, False], ids=["loss-parallel", "gathered"])
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_gemma_matches_one_device(family, sp, loss_parallel):
    for r in get_world(2).run(tasks.gemma_case, family, sp, loss_parallel):
        _matched(r, loss_parallel)


@pytest.mark.parametrize(
    ("family", "control"), [("gemma2", "no_final_softcap"), ("gemma3", "no_embedding_scale")]
)
def test_a_sharded_copy_without_the_gemma_feature_is_caught(family, control):
    """Negative controls: the same comparison on copies that dropped the feature fails."""
    for r in get_world(2).run(tasks.gemma_case, family, True, True, control):
        assert "refused" not in r, r
        assert r["excess"]["prod-ref:logits"] > 1e-3 and r["excess"]["val-ref:logits"] > 1e-3, r
