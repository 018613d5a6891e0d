"""MLA, per-head parameters and blocks kept whole, planned with zero configuration.

DeepSeek-V2/V3 (both the low-rank q and the plain q variant): latent projections and their
norms replicated, up projections by heads, the shared rope key's gradient partial over tp
and summed — derived by DTensor propagation, and checked against one device row by row.
Cohere's ``[heads, head_dim]`` q/k norms and gpt-oss's sinks follow the heads. Qwen3-Next's
gated DeltaNet and Apertus' MLP (learned xIELU scalars) are planned whole on tp with a note.
Every family matches one device in both modes (loss, logits, every gradient, 2 AdamW steps).
"""

from __future__ import annotations

import pytest
import torch

from hp_core import plan
from hp_core.planner.templates.mla import latent_projections
from hp_core.planner.templates.per_head import head_counts
from hp_core.testing import get_world
from hp_core.testing.families import build_family, family_batch
from tests import dist_tasks_mla as tasks

pytestmark = pytest.mark.distributed
TOL = 1e-5
NO_Q_LORA = {"q_lora_rank": None}
Q_LORA = {"q_lora_rank": 32}


def _assert_matched(r: dict) -> None:
    bad = {k: v for k, v in r["excess"].items() if not v <= TOL}
    assert not bad, f"mismatches above {TOL}: {bad}"
    assert r["n_grads"] > 0 and not any(r["unmoved"].values()), r["unmoved"]
    assert r["collectives"] == 0


CASES = [
    ("deepseek_v2", None, 2),  # plain q_proj (V2-Lite)
    ("deepseek_v2", Q_LORA, 2),
    ("deepseek_v3", None, 2),  # low-rank q
    ("deepseek_v3", NO_Q_LORA, 2),
    ("deepseek_v3", None, 4),
    ("cohere", None, 2),
    ("gpt_oss", None, 2),
    ("qwen3_next", None, 2),
    ("apertus", None, 2),
]


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
@pytest.mark.parametrize(
    ("family", "config", "tp"),
    CASES,
    ids=[
        f"{f}-{'q_lora' if c == Q_LORA else 'no_q_lora' if c else 'row'}-tp{t}" for f, c, t in CASES
    ],
)
def test_family_matches_one_device_unaided(family, config, tp, sp):
    results = get_world(tp).run(tasks.matched, family, sp, config, tp)
    for r in results:
        _assert_matched(r)
    r = results[0]
    attn = r["params"].get("model.layers.0.self_attn", {})
    if family.startswith("deepseek"):
        lora = (config or {}).get("q_lora_rank", 32 if family == "deepseek_v3" else None)
        assert attn["kv_a_proj_with_mqa.weight"] == "R"
        assert attn["kv_a_layernorm.weight"] == "R"
        assert attn["kv_b_proj.weight"] == "S(0)"
        assert attn["o_proj.weight"] == "S(1)"
        if lora:
            assert attn["q_a_proj.weight"] == attn["q_a_layernorm.weight"] == "R"
            assert attn["q_b_proj.weight"] == "S(0)"
            latents = ("kv_a_proj_with_mqa", "kv_a_layernorm", "q_a_proj", "q_a_layernorm")
        else:
            assert attn["q_proj.weight"] == "S(0)" and "q_a_proj.weight" not in attn
            latents = ("kv_a_proj_with_mqa", "kv_a_layernorm")
        for leaf in latents:  # each rank's gradient of a latent is its heads' share
            assert f"model.layers.0.self_attn.{leaf}.weight" in r["partial"]
        heads = 4 // tp
        assert r["local"]["model.layers.0.self_attn.kv_b_proj.weight"] == [heads * 32, 32]
        assert r["local"]["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == [40, 64]
    if family == "cohere":
        assert attn["q_norm.weight"] == attn["k_norm.weight"] == "S(0)"
        assert r["local"]["model.layers.0.self_attn.q_norm.weight"] == [2, 16]  # 4 heads / 2
        assert r["local"]["model.layers.0.self_attn.k_norm.weight"] == [1, 16]  # 2 kv heads / 2
    if family == "gpt_oss":
        assert attn["sinks"] == "S(0)"
        assert r["local"]["model.layers.0.self_attn.sinks"] == [2]  # 4 heads / tp 2
        assert "model.layers.0.self_attn.sinks" not in r["partial"]  # sharded: nothing to sum
    if family == "qwen3_next":
        mixer = r["params"]["model.layers.0.linear_attn"]
        assert set(mixer.values()) == {"R"}
        assert r["params"]["model.layers.1.self_attn"]["q_proj.weight"] == "S(0)"
        assert any("Qwen3NextGatedDeltaNet" in n and "kept whole" in n for n in r["notes"])
    if family == "apertus":
        assert set(r["params"]["model.layers.0.mlp"].values()) == {"R"}
        assert r["params"]["model.layers.0.self_attn"]["q_proj.weight"] == "S(0)"
        assert any("XIELUActivation" in n for n in r["notes"])


@pytest.mark.parametrize("config", [None, Q_LORA], ids=["no_q_lora", "q_lora"])
def test_the_shared_rope_key_gradient_is_summed_over_tp(config):
    """kv_a_proj_with_mqa's last qk_rope_head_dim rows make k_pe, which every head reads: each
    rank's gradient there is its heads' share. With the derived reduction the rows match one
    device; with it dropped (negative control) production's k_pe rows are off by the other
    rank's share, and validate notices or is off too."""
    kept = get_world(2).run(tasks.k_pe_rows, "deepseek_v2", False, config)[0]
    assert kept["derived"] == [tasks.KV_A.format(0), tasks.KV_A.format(1)]
    for mode in ("production", "validate"):
        assert kept[mode]["k_pe"] <= TOL * 10 and kept[mode]["latent"] <= TOL * 10, kept
        assert kept[mode]["scale"] > 1e-3  # a real gradient, not zeros on both sides
        assert kept[mode]["gather"] == "ok"
    dropped = get_world(2).run(tasks.k_pe_rows, "deepseek_v2", True, config)[0]
    prod = dropped["production"]
    assert prod["k_pe"] > 0.1 * prod["scale"], dropped  # off by the other rank's share
    assert "replicas differ" in prod["gather"] and tasks.KV_A.format(0) in prod["gather"]
    val = dropped["validate"]
    assert "caught" in val or val["k_pe"] > 0.1 * val["scale"], dropped


def test_without_the_broadcast_rule_the_verifier_refuses_mla():
    """Negative control: hp's broadcast rule is what makes MLA provable; DTensor alone
    re-slices the shared rope key (and would all-gather its gradient)."""
    r = tasks.without_broadcast_rule("deepseek_v3")
    assert r["refused"] == "UndeclaredCommunicationError", r
    assert "model.layers.0.self_attn" in r["message"]


def test_the_sliding_window_matters_in_the_gpt_oss_row():
    """gpt-oss's sliding layer has a window shorter than the test sequence: its mask changes
    the logits (so matching one device covers the sliding mask on sharded heads)."""
    ids = family_batch("gpt_oss")
    short = build_family("gpt_oss", seed=0)
    long = build_family("gpt_oss", seed=0, sliding_window=256)
    assert short.config.sliding_window < ids.shape[1]
    with torch.no_grad():
        a = short(input_ids=ids).logits
        b = long(input_ids=ids).logits
    assert (a - b).abs().max().item() > 1e-3


def test_detection_reads_shapes_not_names():
    """MLA and head counts come from the modules' shapes and config: renamed projections are
    found the same way, and a llama attention is no MLA block."""
    v3 = build_family("deepseek_v3", device="meta")
    attn = v3.model.layers[0].self_attn
    got = latent_projections(attn)
    assert got is not None
    assert set(got.down) == {"q_a_proj", "kv_a_proj_with_mqa"}
    assert set(got.up) == {"q_b_proj", "kv_b_proj"} and got.out == ("o_proj",)
    for old, new in (("q_a_proj", "wq_a"), ("kv_b_proj", "wkv_b")):
        attn.add_module(new, attn._modules.pop(old))
    renamed = latent_projections(attn)
    assert renamed is not None and "wq_a" in renamed.down and "wkv_b" in renamed.up
    llama = build_family("llama", device="meta").model.layers[0].self_attn
    assert latent_projections(llama) is None
    assert head_counts(llama) == (4, 2, 16)


def test_plans_without_tp_keep_every_block_as_before():
    """On a cp-only mesh nothing is split on tp, so no block is kept whole and no note added."""
    m = build_family("qwen3_next", device="meta")
    p = plan(m, "cp=2")
    assert not any("kept whole" in n for n in p.notes)
    assert plan(m, "tp=2").modules["model.layers.0.linear_attn"].region_dispatch is False


def test_deepseek_v3_with_expert_parallelism():
    """MLA on tp=2 next to the routed experts on ep=2 (hp-plugin-moe's deepseekv3 compute;
    the expert group spans tp, so tokens must be sequence-sharded: sp on): loss, logits and
    every gradient match one device in both modes; each rank holds 2 of the 4 experts."""
    for r in get_world(2).run(tasks.with_experts, "deepseek_v3", True):
        for mode in ("production", "validate"):
            assert all(v <= TOL for v in r[mode].values()), r
            assert r[f"{mode}:experts"] == {
                "model.layers.1.mlp.experts.gate_up_proj": [2, 64, 64],
                "model.layers.1.mlp.experts.down_proj": [2, 64, 32],
            }


def test_head_counts_need_a_head_count_and_a_width():
    """Modules that say nothing about heads are not MLA and have no per-head parameters."""

    class Heads(torch.nn.Module):
        num_heads = 4

    assert head_counts(torch.nn.Linear(4, 4)) is None
    assert head_counts(Heads()) is None  # no head_dim, no hidden size
    assert latent_projections(Heads()) is None
