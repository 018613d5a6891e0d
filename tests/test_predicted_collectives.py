"""Predicted == measured: every collective of one training step, plugins included.

``step_collectives`` with the mesh's sizes reads the one transition table
(``hp_core.collectives``) for the plan's boundaries and each plugin item's declared
collectives (CP's packed K/V gather, EP's all-to-alls); ``CollectiveCounter`` counts
what one forward and one backward in production mode really issue. One spawned world
per size serves every case of that size.
"""

from __future__ import annotations

import pytest

from hp_core.testing import get_world
from tests import dist_tasks_predicted as tasks

pytestmark = pytest.mark.distributed
pytest.importorskip("hp_plugin_cp")
pytest.importorskip("hp_plugin_moe")


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for size in (2, 4):
        names = [n for n, case in tasks.CASES.items() if case[0] == size]
        per_rank = get_world(size).run(tasks.predicted_and_measured, names)
        assert all(r == per_rank[0] for r in per_rank), "every rank issues the same collectives"
        out.update(per_rank[0])
    return out


@pytest.mark.parametrize("case", list(tasks.CASES))
def test_predicted_equals_measured(results, case):
    r = results[case]
    assert r["measured"]["forward"] and r["measured"]["backward"]  # the counter did count
    assert r["measured"] == r["predicted"]


def test_plugins_add_their_declared_collectives(results):
    # CP: one packed K/V gather per attention call forward, its reduce-scatter backward;
    # EP: 3 all-to-alls per MoE call forward, 2 backward (2 layers each).
    assert results["cp"]["measured"]["forward"].get("all_gather") == 2
    assert results["cp"]["measured"]["backward"].get("reduce_scatter") == 2
    only_all_to_all = {"forward": {"all_to_all": 6}, "backward": {"all_to_all": 4}}
    assert results["ep"]["measured"] == only_all_to_all
