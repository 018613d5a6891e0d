"""The multi-process test harness itself."""

from __future__ import annotations

import pytest

from hp_core.testing import World, WorldError, WorldTaskError, WorldTimeoutError, get_world
from tests import dist_tasks_world as tasks

pytestmark = pytest.mark.distributed


def test_world_runs_collectives_and_is_reused():
    w = get_world(2)
    assert w.run(tasks.all_reduce_rank) == [(0, 3.0), (1, 3.0)]
    assert get_world(2) is w
    assert w.run(tasks.all_reduce_rank) == [(0, 3.0), (1, 3.0)]


def test_rank_failure_carries_traceback_and_world_survives():
    w = get_world(2)
    with pytest.raises(WorldTaskError) as e:
        w.run(tasks.fail_on_rank, 1)
    assert sorted(e.value.failures) == [1]
    assert "ValueError: boom on rank 1" in str(e.value) and "--- rank 1 ---" in str(e.value)
    assert isinstance(e.value.exceptions[1], ValueError)
    assert w.run(tasks.fail_on_rank, 5) == [0, 1]


def test_hang_becomes_timeout_and_a_fresh_world_follows():
    w = get_world(2)
    with pytest.raises(WorldTimeoutError, match="did not finish in time"):
        w.run(tasks.hang_unless_rank0, timeout=3)
    assert not w.alive
    with pytest.raises(WorldError, match="closed"):
        w.run(tasks.all_reduce_rank)
    w2 = get_world(2)
    assert w2 is not w and w2.run(tasks.all_reduce_rank)[0] == (0, 3.0)


def test_world_size_validated():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        World(0)


def test_unpicklable_exception_and_result_are_reported():
    w = get_world(2)
    with pytest.raises(WorldTaskError) as e:
        w.run(tasks.raise_unpicklable)
    assert e.value.exceptions == {0: None, 1: None} and "_Unpicklable: cannot travel" in str(
        e.value
    )
    with pytest.raises(WorldTaskError, match="cannot be sent back"):
        w.run(tasks.return_unpicklable)
    assert w.run(tasks.all_reduce_rank)[1] == (1, 3.0)


def test_failure_while_others_wait_tears_the_world_down():
    w = get_world(2)
    with pytest.raises(WorldTaskError, match="rank 1 gave up"):
        w.run(tasks.fail_rank1_while_rank0_waits, failure_grace=2)
    assert not w.alive


def test_dead_rank_is_reported_and_replaced():
    w = get_world(2)
    with pytest.raises(WorldError, match=r"rank\(s\) \[1\] died \(exit codes \{1: 3\}\)"):
        w.run(tasks.die_on_rank1, timeout=60)
    assert get_world(2).run(tasks.all_reduce_rank)[0] == (0, 3.0)


def test_collective_counter_counts_ops_and_bytes():
    calls, sent, total = get_world(2).run(tasks.count_with_probe)[0]
    assert calls == {"all_reduce": 1, "all_gather": 1, "all_to_all": 1} and total == 3
    assert sent == 3 * 4 * 4  # three collectives of 4 float32 each
