"""DDP (or HF Trainer through accelerate) over the tp ranks of an hp model is an error."""

from __future__ import annotations

import pytest

from hp_core.testing.world import get_world
from tests import dist_tasks_outer as tasks

pytestmark = pytest.mark.distributed


def test_ddp_over_the_tp_ranks_is_refused_at_the_first_forward():
    for rank, r in enumerate(get_world(2).run(tasks.ddp_over_world)):
        assert r["plain_ok"]
        assert r["type"] == "WrappedOverModelParallelRanksError", r
        assert "wrapped in DistributedDataParallel over ranks [0, 1]" in r["message"]
        assert f"rank(s) [{1 - rank}] of this rank's tp group" in r["message"]
        assert (
            "process_group=" in r["message"]
            and "HpTrainer" in r["message"]
            and "docs/training.md" in r["message"]
        )
