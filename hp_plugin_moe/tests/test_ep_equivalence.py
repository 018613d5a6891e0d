"""Expert parallelism on real HF MoE models: sharded == single device, production == validate.

Each case runs real gloo ranks, applies the plan to a production-mode copy and a
validate-mode copy of the same (perturbed, seeded) weights, and compares loss, logits
and every gradient (gathered without hp's placement tables) with single-device runs
(fp32, rtol = atol = 1e-5). With a ``dp`` axis each dp slice trains its own batch and an
expert's gradient is the sum over the slices its expert group spans (see ``moe_tasks``).
Every optimizer step must move every parameter that has a gradient, on every rank.
"""

from __future__ import annotations

import moe_tasks as tasks
import pytest

from hp_core.testing import get_world
from hp_core.testing.compare import nan_safe_max

pytestmark = pytest.mark.distributed
TOL = 1e-5


def _check(result: dict, *, experts: int, ep: int) -> None:
    bad = {k: v for k, v in result.items() if ":" in k and not v <= TOL}  # NaN-safe: NaN is bad
    assert not bad, f"mismatches above {TOL}: {bad}"
    assert result["n_grads"] > 0 and result["n_expert_grads"] > 0
    assert result["local_expert_shape"][0] == experts // ep  # this rank really holds E / ep experts
    # The optimizer really stepped: each step moved every weight with a gradient (all models).
    stuck = {k: v for k, v in result["not_stepped"].items() if v}
    assert not stuck, (
        f"the optimizer step did not move (or made non-finite) these parameters: {stuck}"
    )


@pytest.mark.parametrize(
    "family,world,shape,names,ep,config,experts,group,syncs",
    [
        # ep borrowed across the two tp ranks (sequence parallel: each rank routes its own tokens)
        ("qwen2moe", 2, (2,), ("tp",), 2, {}, 4, [0, 1], 0),
        ("mixtral", 2, (2,), ("tp",), 2, {}, 4, [0, 1], 0),
        # a world-2 mesh without tp: experts split over data-parallel ranks, each with its own batch
        ("qwen2moe", 2, (2,), ("dp",), 2, {}, 4, [0, 1], 0),
        ("deepseekv3", 2, (2,), ("dp",), 2, {}, 8, [0, 1], 0),
        # per-expert ModuleList (with biases), stacked into [E, ...] at apply
        ("toy", 2, (2,), ("dp",), 2, {"bias": True}, 4, [0, 1], 0),
        # one expert group over dp x tp
        ("qwen2moe", 4, (2, 2), ("dp", "tp"), 4, {}, 4, [0, 1, 2, 3], 0),
        # expert groups = tp groups, edp = 2 replicas along dp (reduced by DDP/FSDP, not hp)
        ("mixtral", 4, (2, 2), ("dp", "tp"), 2, {}, 4, None, 0),
        # edp = 2 replicas inside the dense region: hp sums their expert gradients
        ("mixtral", 4, (4,), ("tp",), 2, {"num_key_value_heads": 4}, 4, None, 1),
        ("deepseekv3", 4, (4,), ("dp",), 4, {}, 8, [0, 1, 2, 3], 0),
    ],
    ids=[
        "qwen2moe-tp2-ep2",
        "mixtral-tp2-ep2",
        "qwen2moe-dp2-ep2",
        "deepseekv3-dp2-ep2",
        "per-expert-list-dp2-ep2",
        "qwen2moe-dp2xtp2-ep4",
        "mixtral-dp2xtp2-ep2",
        "mixtral-tp4-ep2-edp2",
        "deepseekv3-dp4-ep4",
    ],
)
def test_ep_matches_single_device(family, world, shape, names, ep, config, experts, group, syncs):
    results = get_world(world).run(tasks.train_compare, family, shape, names, ep=ep, **config)
    for rank, r in enumerate(results):
        _check(r, experts=experts, ep=ep)
        assert r["group"] == (group or [rank - rank % ep + i for i in range(ep)])
        assert r["expert_syncs"] == syncs


def test_stacked_parameters_replace_the_per_expert_modules():
    (r, _) = get_world(2).run(tasks.train_compare, "toy", (2,), ("dp",), ep=2, steps=1)
    assert r["params"] == [
        "model.layers.0.mlp.experts.down_proj.weight",
        "model.layers.0.mlp.experts.gate_proj.weight",
        "model.layers.0.mlp.experts.up_proj.weight",
        "model.layers.0.mlp.gate.weight",
    ]
    assert r["local_expert_shape"] == (2, 32, 64)


@pytest.mark.parametrize(
    "blocked", [(3,), (2, 3)], ids=["expert3-gets-nothing", "rank1-gets-nothing"]
)
def test_routing_that_leaves_experts_without_tokens(blocked):
    """Crafted router weights: the blocked experts (all on ep rank 1) receive no token."""
    results = get_world(2).run(
        tasks.train_compare, "qwen2moe", (2,), ("tp",), ep=2, factory=tasks.spy, blocked=blocked
    )
    for r in results:
        _check(r, experts=4, ep=2)
    # one record per MoE layer and mode: tokens received per local expert
    rank1 = results[1]["received"]
    assert len(rank1) == 4
    for received in rank1:
        assert all(received[e - 2] == 0 for e in blocked)
    assert any(sum(received) > 0 for received in results[0]["received"])
    if blocked == (3,):
        assert all(received[0] > 0 for received in rank1)  # expert 2 still gets tokens


def test_without_sequence_parallel_the_suggested_override_works():
    """tp=2 without SP: preflight refuses (tokens replicated on tp); its pasteable fix is exact."""
    import yaml

    w = get_world(2)
    err = w.run(tasks.apply_error, "replicated_tokens")[0]
    assert err["type"] == "ExpertParallelError" and err["unchanged"]
    snippet = err["message"].split("with an override:\n", 1)[1]
    fix = yaml.safe_load(snippet)
    results = w.run(
        tasks.train_compare,
        "qwen2moe",
        (2,),
        ("tp",),
        ep=2,
        sp=False,
        overrides=tasks.ep_overrides("qwen2moe") + fix,
    )
    for r in results:
        _check(r, experts=4, ep=2)


def test_capacity_factor_from_a_target_drops_tokens_consistently():
    results = get_world(2).run(tasks.capacity_run, 0.5)
    for r in results:
        assert nan_safe_max([r["loss"], r["logits"], r["grad"]]) <= TOL and r["finite"]
        assert len(r["dropped"]) == 4 and all(d > 0 for d in r["dropped"])


@pytest.mark.parametrize("mode,kind", [("production", "Parameter"), ("validate", "DTensor")])
def test_meta_model_stays_meta(mode, kind):
    for r in get_world(2).run(tasks.meta_apply, mode):
        assert r == {"meta": True, "local_shape": (2, 32, 64), "type": kind}
