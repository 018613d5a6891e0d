"""DCP checkpoints of hp models under FSDP2 on dp (world 4: dp=2 x tp=2).

FSDP2 turns each production shard into its own DTensor over dp whose global shape is hp's
shard; hp's state-dict views combine the two into one DTensor over ("dp", "tp"), so the
checkpoint holds every value once, at its place in the full tensor, and reshards to and
from tp-only worlds and one process. Every parameter and the logits are compared with
the single-device model trained alike.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hp_core.testing import get_world
from hp_core.testing.families import build_family, family_batch
from tests import dist_tasks_checkpoint_fsdp as tasks

pytestmark = pytest.mark.distributed

TOL = 1e-6
STRIDED = ("('dp', 'tp')", "(_StridedShard(dim=0, sf=2), Shard(dim=0))")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The production dp x tp checkpoint (sequence parallel on) and its round-trip results."""
    path = str(tmp_path_factory.mktemp("fsdp") / "dp2tp2")
    return path, get_world(4).run(tasks.fsdp_round_trip, path, "production", True)


def _round_trip_holds(results, mode):
    for r in results:
        # FSDP's split sits inside hp's on q (strided on dp), beside it on o_proj; the norm
        # is an ordinary FSDP DTensor (no hp layout), the same in both modes' values.
        q_mesh, q_placements = r["specs"][tasks.Q]
        assert (str(q_mesh), q_placements) == STRIDED, r["specs"]
        assert r["specs"][tasks.O_PROJ] == (("dp", "tp"), "(Shard(dim=0), Shard(dim=1))")
        norm_mesh = ("dp",) if mode == "production" else ("dp", "tp")
        assert r["specs"][tasks.NORM][0] == norm_mesh, r["specs"]
        # = one device's. Validate runs the CPU flash attention kernel on DTensors (hp's
        # strategies): its float32 rounding differs from the reference's by up to ~1.3e-5
        # after the training steps (measured), production's by less than 1e-5.
        trained_tol = 1e-5 if mode == "production" else 2e-5
        assert r["trained"] <= trained_tol and r["logits_vs_ref"] <= 1e-5, r
        assert r["scrambled"] > 0.5  # negative control: the scramble changed every rank
        assert r["restored"] <= TOL and r["logits"] <= TOL, r


def test_production_fsdp2_round_trip(saved):
    _round_trip_holds(saved[1], "production")


def test_an_optimizer_moment_goes_through_the_same_views(saved):
    """What the optimizer-state hooks rely on: an AdamW moment (FSDP's dp DTensor, shaped
    like q_proj's shard) saves as the single-device moment and loads back in FSDP's form."""
    for r in saved[1]:
        assert r["moment_saved"] <= 1e-6 and r["moment_form"] == 0.0, r
        assert r["moment_back"] == 0.0 and r["moment_from_full"] <= 1e-6, r


def test_production_fsdp2_round_trip_without_sequence_parallel(tmp_path):
    path = str(tmp_path / "nosp")
    results = get_world(4).run(tasks.fsdp_round_trip, path, "production", False)
    _round_trip_holds(results, "production")


def test_validate_fsdp2_round_trip(tmp_path):
    path = str(tmp_path / "validate")
    _round_trip_holds(get_world(4).run(tasks.fsdp_round_trip, path, "validate", True), "validate")


def test_dp_tp_checkpoint_reshards_to_tp4_tp2_and_one_process(saved):
    path = saved[0]
    for tp in (4, 2):
        for r in get_world(tp).run(tasks.load_at_tp, path, tp):
            assert r["before"] > 0.01  # negative control: the fresh model's weights differ
            assert r["params"] <= TOL and r["logits"] <= 1e-5, (tp, r)
    reference = torch.load(f"{path}.reference.pt")
    whole = build_family("llama", seed=1, **tasks._kv4())
    state = whole.state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    whole.load_state_dict(state)
    params = {k: v.detach() for k, v in whole.state_dict().items()}
    assert tasks._excess(params, reference["params"]) <= TOL
    with torch.no_grad():
        logits = whole(input_ids=family_batch("llama", batch=2, seq=16), use_cache=False).logits
    assert float((logits - reference["logits"]).abs().max()) <= 1e-5


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_tp4_checkpoint_loads_into_dp_tp_fsdp2(tmp_path, mode):
    path = str(tmp_path / "tp4")
    assert all(get_world(4).run(tasks.save_at_tp4, path))
    for r in get_world(4).run(tasks.load_into_fsdp, path, mode):
        assert r["before"] > 0.01  # negative control
        assert r["params"] <= TOL and r["logits"] <= 1e-5, r


def test_a_checkpoint_of_another_shape_is_refused(tmp_path):
    for r in get_world(4).run(tasks.load_a_wider_checkpoint, str(tmp_path / "wide")):
        assert r["error"] is not None, r
        # DCP's own error, raised on every rank before anything is written; it names the key.
        assert r["error"].startswith("CheckpointException"), r["error"]
        assert (
            "Size mismatch between saved torch.Size([64, 256]) and current: "
            "torch.Size([64, 128]) for model.layers.0.mlp.down_proj.weight"
        ) in r["error"], r["error"]
        assert r["unchanged"] == 0.0, r


def test_an_uneven_split_torch_would_misplace_is_saved_gathered_over_dp(tmp_path):
    """dp=3 x tp=2 (world 6): FSDP's 2+2+0 / 1+1+1 split of hp's 4- and 3-row shards."""
    path = str(tmp_path / "uneven")
    results = get_world(6).run(tasks.uneven_dp3, path)
    assert any(r["misplaced"] for r in results)  # the case the fallback exists for
    for r in results:
        # saved as hp's tp shard, replicated over dp (4 or 3 rows: gathered, not FSDP's)
        assert r["saved"][0] == (("dp", "tp"), "(Replicate(), Shard(dim=0))"), r
        assert r["saved"][1] in (4, 3), r
        assert r["restored"] == 0.0 and r["checked"] == 0.0, r
    whole = {"weight": torch.zeros(7, 3)}
    dcp.load(whole, checkpoint_id=path, no_dist=True)
    assert torch.equal(whole["weight"], torch.arange(21.0).reshape(7, 3))  # every row in place
    # negative control: FSDP's slices saved under _StridedShard make a broken checkpoint
    with pytest.raises(CheckpointException, match="mismatch sizes"):
        dcp.load({"weight": torch.zeros(7, 3)}, checkpoint_id=f"{path}.strided", no_dist=True)


@pytest.mark.parametrize("hp_on", ["root", "tp"])
def test_full_tensors_other_meshes_and_dcp_load_into_fsdp2_shards(tmp_path, hp_on):
    """hp on the (dp, tp) mesh (dp replicated in its layouts) or on its "tp" slice: the
    view is the same DTensor over (dp, tp) either way."""
    for r in get_world(4).run(tasks.other_forms, str(tmp_path / hp_on), hp_on):
        assert r["specs"][tasks.Q] == (("dp", "tp"), STRIDED[1]), r
        assert r["hp_keys"] == 16, r  # embedding, 2 x 7 projections, head (norms: FSDP's)
        assert r["from_full"] <= TOL and r["from_plain"] <= TOL and r["from_flat"] <= TOL, r
        assert r["from_hp_mesh"] <= TOL, r
        assert r["round_trip"] <= TOL and r["checked"] <= TOL, r
        assert r["error"] is not None and r["error"].startswith(
            f"StateDictLayoutError: {tasks.Q}: the state dict holds a DTensor of shape "
            "(32, 64), but the parameter is (64, 64) as {"
        ), r["error"]
        assert r["unchanged"] == 0.0, r


def test_fsdp_own_dp_dtensors_would_lose_the_tp_shards(tmp_path):
    """Negative control: without hp's combined view, DCP keeps one tp rank's values."""
    restored = [r["restored"] for r in get_world(4).run(tasks.raw_fsdp_dtensors, str(tmp_path))]
    assert max(restored) > 0.01, restored


def test_a_dp_mesh_that_does_not_combine_with_hps_is_named():
    for r in get_world(4).run(tasks.meshes_that_do_not_combine):
        apart, crossed = r["errors"]
        assert apart is not None and apart.startswith(
            "FsdpViewError: model.embed_tokens.weight: FSDP2's mesh ('b',) and hp's layout "
            "mesh ('tp',) do not combine into one mesh"
        ), apart
        assert crossed is not None and crossed.startswith(
            "FsdpViewError: model.embed_tokens.weight: FSDP2 shards it over the mesh dims "
            "('dp',), but hp lays it out as (128, 64) as {dp: replicate, tp: shard(0)}"
        ), crossed
        for error in (apart, crossed):
            assert "Fix: pass fully_shard a dp mesh sliced from" in error
