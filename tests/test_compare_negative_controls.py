"""The comparison helpers must catch broken runs: negative controls on a real gloo world of 2.

Every equivalence test trusts ``hp_core.testing.compare``. Each case here breaks a correct
tp=2 run of the tiny llama in one known way (NaN gradients, a no-op optimizer, shards
swapped across ranks, a replicated gradient nobody reduced, an unreduced ``Partial``
gradient in validate mode) and asserts the helpers report it; the positive control
asserts the same helpers pass the correct run.
"""

from __future__ import annotations

import math

import pytest

from hp_core.testing import get_world
from tests import dist_tasks_compare as tasks

pytestmark = pytest.mark.distributed
TOL = 1e-5


def _run(fn):
    return get_world(2).run(fn)


def test_positive_control_correct_tp2_run_passes_in_both_modes():
    for r in _run(tasks.positive_control):
        bad = {
            k: v
            for k, v in r.items()
            if k.split(":")[-1] in ("loss", "logits", "grad") and not v <= TOL
        }
        assert not bad, f"a correct run fails the comparison: {bad}"
        # The independent gatherer and hp's table-driven full_grads give the same tensors.
        assert r["prod:agree"] == 0.0 and r["val:agree"] == 0.0
        assert r["n_grads"] > 0 and r["n_gathered"] == {"prod": r["n_grads"], "val": r["n_grads"]}
        # Every parameter moved in every step, in the reference and in both parallel copies.
        # (to finite values: a weight made NaN/inf would be listed as unmoved)
        assert all(
            r[f"{k}:unmoved"] == [] and r[f"{k}:checked"] > 0 for k in ("ref", "prod", "val")
        )
        # Replicated gradients were checked across the tp ranks and agree far inside the tolerance.
        assert tasks.NORM in r["replica_checked"] and tasks.Q_PROJ not in r["replica_checked"]
        assert r["replica_spread"] <= 1e-7


def test_nan_or_inf_anywhere_is_an_infinite_excess():
    for r in _run(tasks.nan_control):
        assert all(v <= TOL for v in r["clean"].values()), r["clean"]
        assert r["nan_grad"]["grad"] == math.inf and r["nan_grad"]["loss"] <= TOL
        assert r["inf_grad"]["grad"] == math.inf
        assert r["nan_logits"]["logits"] == math.inf and r["nan_logits"]["grad"] <= TOL
        assert r["nan_loss"]["loss"] == math.inf
        assert r["all_nan"] == {"loss": math.inf, "logits": math.inf, "grad": math.inf}


def test_a_no_op_optimizer_is_flagged():
    for r in _run(tasks.noop_optimizer_control):
        noop, real = r[0.0], r[1e-3]
        assert noop["losses_differ"]  # the old check: it holds even with lr=0 ...
        assert noop["max_change"] == 0.0  # ... but nothing moved
        assert noop["unmoved"] == noop["params"] and len(noop["params"]) == noop["n_params"] > 0
        assert (
            noop["flagged"]
            and f"{noop['n_params']} of {noop['n_params']} parameter(s) did not change"
            in noop["flagged"]
        )
        assert real["unmoved"] == [] and real["flagged"] is None and real["n_params"] > 0
        assert 0.0 < real["max_change"] < math.inf


def test_shards_swapped_across_ranks_are_a_mismatch():
    for r in _run(tasks.permuted_layout_control):
        assert r["before"] <= TOL
        assert r["after"] > 10 * TOL and r["run_grad"] > 10 * TOL  # caught, far above the tolerance
        # hp's table-driven full_grads gathers the swapped shards in the same wrong order: caught
        # too
        assert r["table_gather"] > 10 * TOL
        assert r["is_the_swap"] == 0.0  # it gathered exactly the swapped tensor, canonically
        assert r["others"] <= TOL  # and nothing else moved


def test_a_replicated_gradient_that_differs_across_ranks_is_caught():
    results = _run(tasks.replica_control)
    injected = max(r["max_injected"] for r in results)
    for rank, r in enumerate(results):
        assert r["clean"] is None and r["rounding"] is None
        # Every rank raises, naming the parameter, the axis and the difference between ranks.
        for key in ("unreduced", "strict"):
            assert r[key] and f"{tasks.NORM}: replicas differ across mesh axis 'tp'" in r[key], r[
                key
            ]
        difference = float(r["unreduced"].split("between ranks = ")[1].split(" ")[0])
        assert 0.5 * injected < difference <= 1.01 * injected
        # Rank-local comparisons alone would miss it on the untouched rank.
        assert (r["local_excess"] <= TOL) == (rank == 0)


def test_an_unreduced_partial_gradient_fails_in_validate_mode():
    for r in _run(tasks.unreduced_validate_control):
        assert r["clean"] is None and r["restored"] is None
        assert r["placements"] == ["Replicate()"]
        assert r["hidden"] <= TOL  # DTensor.full_tensor() sums the partials: right-looking
        assert r["partial"] and f"{tasks.NORM}: unreduced gradient" in r["partial"]
        assert "Partial(sum)" in r["partial"]
        assert (
            r["replicas"]
            and f"{tasks.NORM}: replicas differ across mesh axis 'tp'" in r["replicas"]
        )
        assert (
            r["other_placement"]
            and f"{tasks.NORM}: gradient placements [Shard(dim=0)] differ" in r["other_placement"]
        )


def test_layouts_matching_nothing_are_named_with_both_shapes():
    vs = "vs the reference's"
    for r in _run(tasks.layout_errors):
        err = r["error"]
        assert err and err.startswith("6 gradient problem(s):"), err
        lines = [line.strip() for line in err.splitlines()[1:]]
        assert [line.split(":")[0] for line in lines] == ["b", "c", "d", "f", "g", "z"]  # a, e fine
        assert lines[0].startswith(f"b: local shape [4, 3] {vs} [8, 6]: dims [0, 1] differ")
        assert lines[1].startswith(f"c: local shape [8, 2] {vs} [8, 6]: dim 1 is split 3 ways")
        assert "matches no mesh axis (non-data axes {'tp': 2})" in lines[1]
        assert lines[2] == "d: local shapes differ across ranks {0: [8, 6], 1: [4, 6]}"
        assert lines[3] == f"f: local shape [8, 6, 1] {vs} [8, 6]: the numbers of dims differ"
        assert lines[4].startswith(f"g: local shape [5, 6] {vs} [8, 6]: dim 0 is no even split")
        assert lines[5] == "z: not a parameter of the reference"
        sets = "rank 1 has gradients for another set of parameters: ['e']"
        assert r["sets"] and sets in r["sets"]
        assert "mesh_dim_names" in r["unnamed"]
        assert r["unknown_axis"] == "replica_axes ['cp'] are not axes of the mesh ['tp']"


def test_expert_parameters_gather_over_the_given_expert_group():
    for r in _run(tasks.expert_gather):
        assert r["mesh"] == r["group"] == r["list"] == r["none"] == 0.0
        assert "needs an 'ep' dim" in r["bad_mesh"]
        four = "experts.w: local shape [1, 3, 2] vs the reference's [4, 3, 2]: dim 0 is split 4"
        assert r["no_group"] and four in r["no_group"]


def test_expert_parallel_run_passes_and_both_gatherers_agree():
    pytest.importorskip("hp_plugin_moe")
    for r in _run(tasks.expert_positive_control):
        for mode in ("production", "validate"):
            assert all(v <= TOL for v in r[mode].values()), (mode, r[mode])
            assert r[f"{mode}:agree"] == 0.0
            assert r[f"{mode}:experts"] and all(
                s[0] == 2 for s in r[f"{mode}:experts"].values()
            )  # E / ep
