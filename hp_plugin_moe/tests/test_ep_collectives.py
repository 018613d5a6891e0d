"""Exact collectives of expert parallelism, per MoE layer (see docs/ep.md).

Forward: 3 all-to-alls per MoE layer (counts, dispatch, combine); backward: 2 (the
adjoints of dispatch and combine). The rest is the dense plan's own prediction, plus
one bucketed all-reduce per step of the expert gradients when expert replicas inside
the dense region saw different tokens.
"""

from __future__ import annotations

import moe_tasks as tasks
import pytest

from hp_core.testing import get_world

pytestmark = pytest.mark.distributed


def _delta(two: dict, one: dict) -> dict:
    return {k: v for k in set(two) | set(one) if (v := two.get(k, 0) - one.get(k, 0))}


def _plus(a: dict, **b: int) -> dict:
    return {k: a.get(k, 0) + b.get(k, 0) for k in set(a) | set(b) if a.get(k, 0) + b.get(k, 0)}


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_tp2_ep2_per_moe_layer(mode):
    w = get_world(2)
    one, two = (
        w.run(tasks.count_collectives, "qwen2moe", mode, (2,), ("tp",), ep=2, layers=n)[0]
        for n in (1, 2)
    )
    # per decoder layer: the dense SP collectives of attention, plus the MoE block's all-to-alls
    assert _delta(two["forward"], one["forward"]) == {
        "all_gather": 1,
        "reduce_scatter": 1,
        "all_to_all": 3,
    }
    assert _delta(two["backward"], one["backward"]) == {
        "all_gather": 1,
        "reduce_scatter": 1,
        "all_to_all": 2,
    }
    for n, r in ((1, one), (2, two)):
        assert r["forward"] == _plus(r["pred_forward"], all_to_all=3 * n)
        assert r["backward"] == _plus(r["pred_backward"], all_to_all=2 * n)
        assert (
            r["sp_sync"] == 1 and r["expert_sync"] == 0
        )  # router + shared expert: one bucketed tp sum


def test_ep_over_data_parallel_ranks_is_all_to_all_only():
    w = get_world(2)
    for n in (1, 2):
        r = w.run(tasks.count_collectives, "toy", "production", (2,), ("dp",), ep=2, layers=n)[0]
        assert r["forward"] == {"all_to_all": 3 * n}
        assert r["backward"] == {"all_to_all": 2 * n}


def test_expert_replicas_inside_the_region_add_one_all_reduce():
    r = get_world(4).run(
        tasks.count_collectives,
        "mixtral",
        "production",
        (4,),
        ("tp",),
        ep=2,
        layers=2,
        num_key_value_heads=4,
    )[0]
    assert r["forward"] == _plus(r["pred_forward"], all_to_all=6)
    assert r["backward"] == _plus(r["pred_backward"], all_to_all=4, all_reduce=1)
    assert r["sp_sync"] == 1 and r["expert_sync"] == 1
