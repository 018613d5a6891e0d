"""The proof gate of fused layouts (``hp_core.planner.fused_proof``).

A fused layout is accepted only when the block's forward, traced on meta, runs the same
program on a tp shard with unit counts divided by tp and every per-unit width unchanged.
CodeGen groups ``qkv_proj`` by a constant ``mp_num = 4``: the gate reads those groups off
its forward (where the config says ``[Q; K; V]``). A toy attention that hard-codes its
group count is refused at plan time, naming the op and both shapes; the same toy reading
its head-count attribute is accepted and matches one device in both modes.
"""

from __future__ import annotations

import pytest
import torch

import hp_core
from hp_core.planner import fused_proof
from hp_core.planner.fused_layout import derive
from hp_core.planner.lints import FusedProjectionError
from hp_core.planner.templates.roles import Role
from hp_core.testing import get_world
from hp_core.testing.families import build_family
from tests import dist_tasks_fused_proof as tasks

TOL = 1e-5


def test_codegen_groups_are_read_off_its_forward():
    model = build_family("codegen", seed=0)
    plan = hp_core.plan(model, {"tp": 2}, sequence_parallel=False)
    spec = plan["transformer.h.0.attn"]
    # The config alone says [Q; K; V] (re-arranged, run locally); the forward shows 4 groups.
    attn = model.get_submodule("transformer.h.0.attn")
    weight = attn.qkv_proj.weight
    hint = derive(attn, "qkv_proj.weight", Role.FUSED_QKV, weight, model.config)
    assert (hint.kind, hint.parts) == ("concatenated", (64, 64, 64))
    layout = spec._fused_layouts["qkv_proj.weight"]
    assert (layout["parts"], layout["units"]) == ([192], [4])
    assert spec.region_dispatch is None  # nothing moves: it runs dispatched, validate checks it
    assert spec._tp_local_attr_plan["num_attention_heads"] == (4, 2)


def test_a_group_count_attribute_is_found_by_the_search():
    """``groups`` is no head-count name: the search finds the forward reads it, and the proof
    that dividing it makes the local program the global one scaled is why it is chosen."""
    spec = hp_core.plan(tasks.toy(groups=4), {"tp": 2}, sequence_parallel=False)
    attn = spec["layers.0.self_attn"]
    assert attn._tp_local_attr_plan == {"num_heads": (4, 2), "groups": (4, 2)}
    assert attn.tp_divide_attrs == ["groups"]


def test_a_hard_coded_group_count_is_refused_at_plan_time():
    model = tasks.toy(groups="constant")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(FusedProjectionError) as e:
        hp_core.plan(model, {"tp": 2}, sequence_parallel=False)
    msg = str(e.value)
    assert msg.startswith("layers.0.self_attn: hp cannot prove how ToyAttention's forward")
    assert "reshape (1, 4, 96) -> (1, 4, 4, 24) becomes reshape (1, 4, 48) -> (1, 4, 4, 12)" in msg
    assert (
        "Fix: keep the block whole on tp" in msg and "match: 'layers.*.self_attn'" in msg
    )  # every layer like it
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize(
    ("groups", "parts"), [(None, [96]), ("kv", [32, 32, 32])], ids=["heads", "cut-twice"]
)
def test_the_toys_tp_can_follow_are_accepted_and_match_one_device(groups, parts):
    r = get_world(2).run(tasks.match, groups)[0]
    # Cut twice (q | kv, then k | v): every boundary is a part, so each rank gets k and v.
    assert r["fused"]["layers.0.self_attn"]["qkv_proj.weight"]["parts"] == parts
    bad = {k: v for k, v in r.items() if k != "fused" and not v <= TOL}
    assert not bad, bad


@pytest.mark.parametrize(
    ("family", "fqn", "parts"),
    [
        ("phi3", "model.layers.0.self_attn", [64, 32, 32]),  # slices at query_pos
        ("gpt2", "transformer.h.0.attn", [64, 64, 64]),  # split(split_size) of a Conv1D
        ("dbrx", "transformer.blocks.0.norm_attn_norm.attn", [64, 32, 32]),  # clamp, split
        ("glm4", "model.layers.0.mlp", [128, 128]),  # gate_up chunk(2)
    ],
)
def test_concatenated_layouts_are_read_off_the_cuts(family, fqn, parts):
    plan = hp_core.plan(build_family(family, seed=0), {"tp": 2}, sequence_parallel=False)
    layouts = plan[fqn]._fused_layouts
    assert {tuple(d["parts"]) for d in layouts.values()} == {tuple(parts)}
    assert plan[fqn].region_dispatch is False  # re-arranged: the region runs on local rows


@pytest.mark.parametrize(
    ("groups", "tp", "why"),
    [
        ("width", 2, r"its local program fails on meta \(ValueError"),
        ("transpose", 2, r"the first op on the fused output, transpose .* neither cuts nor"),
        (2, 4, r"part 'qkv' has 2 whole unit\(s\), which tp=4 cannot split"),
    ],
    ids=["constant-width", "moved-first", "two-groups-on-tp4"],
)
def test_what_the_gate_cannot_prove_is_refused(groups, tp, why):
    with pytest.raises(FusedProjectionError, match=why) as e:
        hp_core.plan(tasks.toy(groups=groups), {"tp": tp}, sequence_parallel=False)
    assert "Fix:" in str(e.value) and "match: 'layers.*.self_attn'" in str(e.value)


def test_a_forward_that_does_not_run_on_meta_is_refused():
    with pytest.raises(FusedProjectionError, match=r"does not run on meta \(NotImplementedError"):
        hp_core.plan(tasks.toy(groups="data"), {"tp": 2}, sequence_parallel=False)


def test_a_block_the_model_never_calls_is_refused():
    model = tasks.toy()
    model.layers[1].forward = lambda x: x  # the second layer's attention is never reached
    model.layers[1].self_attn.num_heads = 2  # and differs from the first: proven on its own
    model.layers[1].self_attn.head_dim = 16
    with pytest.raises(FusedProjectionError, match=r"layers.1.self_attn: .* does not reach it"):
        hp_core.plan(model, {"tp": 2}, sequence_parallel=False)


def test_each_distinct_block_is_proven_once(monkeypatch):
    calls = []
    real = fused_proof._prove

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_proof, "_prove", counting)
    torch.manual_seed(0)
    plan = hp_core.plan(tasks.ToyLM(layers=6), {"tp": 2}, sequence_parallel=False)
    assert calls == ["layers.0.self_attn"]
    assert len({str(s._fused_layouts) for _, s in plan.items() if s._fused_layouts}) == 1


def test_cuts_that_do_not_tile_the_fused_dim_are_refused():
    op = fused_proof._Op("split", True, (1, 4, 96), ((1, 4, 32), (1, 4, 32)), (0, 32))
    hint = fused_proof.FusedLayout("concatenated", 0, (32, 32, 32), (4, 4, 4), ("q", "k", "v"))
    assert "do not tile" in str(fused_proof._layout_of([op], hint, 96))
    gap = fused_proof._Op("split", True, (1, 4, 96), ((1, 4, 32), (1, 4, 32)), (0, 64))
    assert "do not tile" in str(fused_proof._layout_of([gap], hint, 96))
    assert "applies no split" in str(fused_proof._layout_of([], hint, 96))
    other = fused_proof._Op("matmul", True, (1, 4, 96), ((1, 4, 4),), ())
    assert "neither cuts nor groups" in str(fused_proof._layout_of([other], hint, 96))


def test_a_local_program_on_another_path_is_refused():
    g = [fused_proof._Op("view", False, (1, 4, 96), ((1, 4, 4, 24),), ())]
    loc = [fused_proof._Op("reshape", False, (1, 4, 48), ((1, 4, 2, 24),), ())]
    assert "applies the ops ['reshape']" in str(fused_proof._compare(g, loc, 2))
    two = [fused_proof._Op("view", False, (1, 4, 48), ((1, 4, 2, 24), (1,)), ())]
    assert "gives 2 outputs" in str(fused_proof._compare(g, two, 2))
    ok = [fused_proof._Op("view", False, (1, 4, 48), ((1, 4, 2, 24),), ())]
    assert fused_proof._compare(g, ok, 2) is None
