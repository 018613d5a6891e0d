"""Fused projections (qkv_proj, c_attn, gate_up_proj) and GPT-2's Conv1D on tp.

The planner derives each fused parameter's layout (``hp_core.planner.fused_layout``); a
concatenated ``[Q; K; V]`` / ``[gate; up]`` is re-arranged so that each rank holds its rows
of every part, interleaved per-head layouts are split as they are. Both modes must match
one device (loss, logits, every gradient, the weights after 2 AdamW steps), every export
path must give back the model's own layout, and what tp cannot split into whole heads is
refused with the module, the layout, the counts and the fix.
"""

from __future__ import annotations

import pytest
import torch

import hp_core
from hp_core.planner.fused_layout import FusedLayout
from hp_core.planner.lints import FusedProjectionError
from hp_core.plans.yaml_io import dump_plan, load_plan
from hp_core.testing import get_world
from hp_core.testing.families import build_family
from hp_core.testing.fused import restore_fused
from tests import dist_tasks_fused as tasks

pytestmark = pytest.mark.distributed
TOL = 1e-5
#: A GQA phi3 that tp=4 splits into whole heads (8 query heads, 4 key/value heads).
PHI3_GQA = {"num_attention_heads": 8, "num_key_value_heads": 4}


def _matched(r: dict) -> None:
    bad = {k: v for k, v in r["excess"].items() if not v <= TOL}
    assert not bad, bad
    assert r["exported"] == {"prod": 0.0, "val": 0.0}, r["exported"]
    assert r["collectives"] == 0


@pytest.mark.parametrize(
    ("family", "kinds"),
    [
        ("phi3", {"concatenated", "gate_up"}),
        ("glm4", {"gate_up"}),
        ("glm", {"gate_up"}),
        ("gpt2", {"concatenated"}),
        ("persimmon", {"interleaved"}),
        ("dbrx", {"concatenated"}),
        ("codegen", {"interleaved"}),  # its forward's mp_num groups (as many as heads here)
    ],
)
def test_family_matches_one_device_in_both_modes_at_tp2(family, kinds):
    results = get_world(2).run(tasks.match, family, 2, False)
    for r in results:
        _matched(r)
        assert {d["kind"] for f in r["fused"].values() for d in f.values()} == kinds, r["fused"]
    assert results[0]["fused"] == results[1]["fused"]


def test_phi3_local_head_counts_and_a_private_config():
    r = get_world(2).run(tasks.match, "phi3", 2, True)[0]  # sequence parallel on
    _matched(r)
    attn = r["attrs"]["model.layers.0.self_attn"]
    assert attn["config.num_attention_heads"] == (4, 2)
    assert attn["num_key_value_heads"] == (2, 1)
    # The attention got a private copy of the config; the MLP (no head counts) kept the shared
    # one, whose head count stays global.
    assert r["shares_config"]["model.layers.0.self_attn"] is False
    assert r["shares_config"]["model.layers.0.mlp"] is True
    assert r["global_heads"] == 4
    assert "fused qkv_proj.weight: concatenated along dim 0 [q 64, k 32, v 32]" in r["explain"]


def test_gqa_phi3_matches_at_tp4():
    for r in get_world(4).run(tasks.match, "phi3", 4, False, **PHI3_GQA):
        _matched(r)


def test_gpt2_conv1d_layouts():
    plan = hp_core.plan(build_family("gpt2", device="meta"), "tp=2", sequence_parallel=False)
    attn, mlp = plan["transformer.h.0.attn"], plan["transformer.h.0.mlp"]
    shard = lambda spec, rel: repr(spec.params[rel]["tp"])  # noqa: E731
    assert shard(attn, "c_attn.weight") == "Shard(dim=1)"  # Conv1D weight [in, out]
    assert shard(attn, "c_attn.bias") == "Shard(dim=0)"
    assert shard(attn, "c_proj.weight") == "Shard(dim=0)"
    assert attn._deferred_bias_params == ("c_proj.bias",)
    assert (
        shard(mlp, "c_fc.weight") == "Shard(dim=1)"
        and shard(mlp, "c_proj.weight") == "Shard(dim=0)"
    )
    assert mlp.region_dispatch is None and attn.region_dispatch is False
    assert attn._fused_layouts["c_attn.weight"]["dim"] == 1
    assert attn._tp_local_attr_plan == {
        "num_heads": (4, 2),
        "split_size": (64, 32),
        "config.num_attention_heads": (4, 2),  # GPT-2's n_head, on a private copy
        "c_attn.nf": (192, 96),
    }


def test_plan_document_carries_the_layouts():
    model = build_family("phi3", device="meta")
    plan = hp_core.plan(model, "tp=2")
    again = load_plan(dump_plan(plan))
    spec = plan["model.layers.0.self_attn"]
    assert again["model.layers.0.self_attn"]._fused_layouts == spec._fused_layouts
    assert again.fingerprint() == plan.fingerprint()


def test_exports_round_trip_in_both_modes(tmp_path):
    for mode in ("production", "validate"):
        for r in get_world(2).run(tasks.roundtrip, "phi3", str(tmp_path), mode, **PHI3_GQA):
            assert r["load_pretrained"] <= TOL and r["dcp_back"] <= TOL, r
            if "from_pretrained" in r:  # rank 0
                assert r["from_pretrained"] <= TOL and r["dcp_one_process"] == 0.0, r


def test_dcp_saved_at_tp2_loads_at_tp4(tmp_path):
    get_world(2).run(tasks.roundtrip, "phi3", str(tmp_path), "production", **PHI3_GQA)
    path = str(tmp_path / "phi3-production-d")
    for mode in ("production", "validate"):
        for worst in get_world(4).run(tasks.dcp_reshard, "phi3", path, mode, **PHI3_GQA):
            assert worst <= TOL, (mode, worst)


def test_gpt2_exports_round_trip(tmp_path):
    for r in get_world(2).run(tasks.roundtrip, "gpt2", str(tmp_path), "production"):
        assert r["load_pretrained"] <= TOL and r["dcp_back"] <= TOL, r
        if "from_pretrained" in r:
            assert r["from_pretrained"] <= TOL and r["dcp_one_process"] == 0.0, r


def test_negative_control_contiguous_shards_are_caught():
    """Without the re-arrangement a rank's rows of [Q; K; V] are all of Q (rank 0) or K and
    V (rank 1): the comparison must see it, in both modes."""
    for r in get_world(2).run(tasks.contiguous_control, "phi3"):
        assert r["prod"] > 1e-3 and r["val"] > 1e-3, r


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_a_layout_that_does_not_add_up_is_refused(mode):
    for r in get_world(2).run(tasks.bad_descriptor, "phi3", mode):
        assert r["type"] == "FusedProjectionError", r
        assert r["where"] in r["message"] and "Fix:" in r["message"], r["message"]
        assert r["untouched"]


def test_heads_tp_cannot_split_are_refused_at_plan_time():
    model = build_family("phi3", device="meta")  # 4 query heads, 2 key/value heads
    with pytest.raises(FusedProjectionError) as e:
        hp_core.plan(model, "tp=4")
    msg = str(e.value)
    assert "model.layers.0.self_attn.qkv_proj.weight" in msg
    assert "concatenated along dim 0" in msg and "part 'k' has 2 whole unit(s)" in msg
    assert "tp=4" in msg and "Fix:" in msg


def test_multi_query_c_attn_is_refused():
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    cfg = GPTBigCodeConfig(
        vocab_size=128, n_embd=64, n_layer=1, n_head=4, n_positions=64, multi_query=True
    )
    with torch.device("meta"):
        model = GPTBigCodeForCausalLM(cfg)
    with pytest.raises(FusedProjectionError) as e:
        hp_core.plan(model, "tp=2", sequence_parallel=False)
    msg = str(e.value)
    assert "transformer.h.0.attn.c_attn.weight" in msg and "multi-query" in msg
    assert "[q 64 (4 units), k 16 (1 unit), v 16 (1 unit)]" in msg and "Fix:" in msg


def test_interleaved_layouts_need_no_rearrangement():
    interleaved = FusedLayout("interleaved", 0, (96,), (4,), ("qkv",))
    assert interleaved.index(2) is None
    concat = FusedLayout("concatenated", 0, (4, 2, 2), (2, 2, 2), ("q", "k", "v"))
    assert concat.index(2).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert concat.index(1) is None


def test_restore_fused_undoes_the_rank_order():
    """The test helper's own arithmetic agrees with the runtime's re-arrangement."""
    from hp_core.runtime.fused import FusedShards

    plan = hp_core.plan(build_family("phi3", device="meta"), "tp=2")
    spec = plan["model.layers.0.self_attn"]
    layout = FusedLayout.from_data(spec._fused_layouts["qkv_proj.weight"])
    w = torch.arange(128 * 64, dtype=torch.float32).reshape(128, 64)
    shuffled = FusedShards(layout, 2).rearrange(w)
    assert not torch.equal(shuffled, w)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(restore_fused({name: shuffled}, plan, 2)[name], w)
    assert torch.equal(FusedShards(layout, 2).restore(shuffled), w)


def test_malformed_layouts_in_a_plan_document_are_refused():
    with pytest.raises(FusedProjectionError, match="is not a fused layout"):
        FusedLayout.from_data({"kind": "concatenated"}, "x")
    with pytest.raises(FusedProjectionError, match="kind must be one of"):
        FusedLayout.from_data(
            {"kind": "zigzag", "dim": 0, "parts": [1], "units": [1], "names": ["a"]}, "x"
        )


def test_freeze_and_rebuild_carry_the_layouts():
    from hp_core.artifact import freeze, rebuild

    model = build_family("phi3", device="meta")
    plan = hp_core.plan(model, "tp=2")
    meta = freeze(plan)
    (rule,) = [r for r in meta["injections"] if r["match"] == "model.layers.0.self_attn"]
    assert rule["fused_layouts"]["qkv_proj.weight"]["parts"] == [64, 32, 32]
    again = rebuild(meta, model=model)
    for fqn, spec in plan.items():
        assert again[fqn]._fused_layouts == spec._fused_layouts, fqn
        assert again[fqn]._tp_local_attr_plan == spec._tp_local_attr_plan, fqn


def _falcon(**cfg):
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, **cfg
    )
    with torch.device("meta"):
        return FalconForCausalLM(config)


def test_falcon_kv_groups_split_as_they_are_and_multi_query_is_refused():
    model = _falcon(new_decoder_architecture=True, num_kv_heads=2, multi_query=False)
    spec = hp_core.plan(model, "tp=2", sequence_parallel=False)["transformer.h.0.self_attention"]
    layout = spec._fused_layouts["query_key_value.weight"]
    # per kv group [q q k v]: 2 groups; transformers 5.25 views each group as (-1, head_dim),
    # so the proof reads the finer head-width units (2 groups x 4) — a contiguous half is one
    # whole group either way, and tp=4 (half a group each) is refused below
    assert layout["kind"] == "grouped" and layout["units"] in ([2], [8])
    assert spec.region_dispatch is None  # contiguous shards are whole groups: nothing moves
    with pytest.raises(FusedProjectionError, match="2 whole unit"):
        hp_core.plan(model, "tp=4", sequence_parallel=False)
    with pytest.raises(FusedProjectionError, match="multi-query"):
        hp_core.plan(_falcon(multi_query=True), "tp=2", sequence_parallel=False)


def test_a_config_that_does_not_describe_the_weight_is_refused():
    model = build_family("phi3", device="meta")
    for layer in model.model.layers:
        layer.self_attn.num_key_value_heads = 4  # the weight was built for 2
    with pytest.raises(FusedProjectionError) as e:
        hp_core.plan(model, "tp=2")
    msg = str(e.value)
    assert msg.startswith("model.layers.0.self_attn.qkv_proj.weight: fused projection of shape")
    assert "cannot tell how the forward splits it" in msg and "- match: " in msg


def test_a_fused_weight_sharded_off_its_fused_dim_is_not_rearranged():
    model = build_family("phi3", device="meta")
    params = {"qkv_proj.weight": {"tp": "shard(1)"}, "o_proj.weight": {"tp": "replicate"}}
    over = [{"match": "model.layers.*.self_attn", "params": params}]
    spec = hp_core.plan(model, "tp=2", overrides=over)["model.layers.0.self_attn"]
    assert "qkv_proj.weight" not in spec._fused_layouts


def test_nothing_moves_for_one_part_and_zero_biases():
    from hp_core.runtime.fused import FusedShards
    from hp_core.runtime.fused_views import zero_bias

    one = FusedShards(FusedLayout("interleaved", 0, (8,), (4,), ("qkv",)), 2)
    t = torch.arange(8.0)
    assert one.restore(t) is t and one.rearrange(t) is t and not one.moves
    assert zero_bias(None, None, False) is None  # type: ignore[arg-type]
    assert torch.equal(zero_bias(torch.ones(3), None, False), torch.zeros(3))  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_a_failed_apply_gives_back_the_shared_config(mode):
    for r in get_world(2).run(tasks.config_rollback, mode):
        assert r["raised"] is not None, r
        assert r["same_config"] and r["heads"] == 4 and r["kv"] and not r["marker"], r


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_optimizer_moments_save_at_tp2_and_load_at_tp4(tmp_path, mode):
    path = str(tmp_path / "optim")
    for worst in get_world(2).run(tasks.optimizer_roundtrip, "phi3", path, mode, True, **PHI3_GQA):
        assert worst <= TOL, worst
    for worst in get_world(4).run(tasks.optimizer_roundtrip, "phi3", path, mode, False, **PHI3_GQA):
        assert worst <= TOL, worst
