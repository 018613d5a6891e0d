"""MoE boundaries: replicated experts without EP; ``ep: shard(0)``, ``_ep_size`` and
``_ep_stack`` with ``ep_size > 1``, for batched (transformers 5.x) and per-expert
``ModuleList`` experts."""

from __future__ import annotations

import pytest
import torch

from hp_core import plan
from hp_core.planner.lints import DivisibilityError, MeshAxisError
from hp_core.presets import build_model
from tests._planner_helpers import (
    L,
    builtin_only,  # noqa: F401  (fixture)
    contract,
)
from tests._toy_models import list_moe_lm

pytestmark = pytest.mark.usefixtures("builtin_only")

SHARDED = L(tp="shard(1)")
QWEN_MOE_PARAMS = (
    "gate.weight",
    "experts.gate_up_proj",
    "experts.down_proj",
    "shared_expert.gate_proj.weight",
    "shared_expert.up_proj.weight",
    "shared_expert.down_proj.weight",
    "shared_expert_gate.weight",
)


def meta(family: str, **kw) -> torch.nn.Module:
    return build_model(family, device="meta", **kw)


def moe_contract(
    params: dict, ep_size: int = 0, stack: dict | None = None, between=SHARDED
) -> dict:
    out = {
        "params": params,
        "in_src": {"hidden_states": between},
        "in_dst": {"hidden_states": between},
        "out_src": {"output": between},
        "out_dst": {"output": between},
        "region_dispatch": False,
    }
    if ep_size:
        out["_ep_size"] = ep_size
    if stack:
        out["_ep_stack"] = stack
    return out


def test_qwen2moe_without_ep_replicates_the_whole_block_and_runs_on_local_tokens():
    p = plan(meta("qwen2moe"), "tp=2")
    assert contract(p["model.layers.0.mlp"]) == moe_contract(
        {k: L(tp="replicate") for k in QWEN_MOE_PARAMS}
    )
    # the shared expert belongs to the MoE block, not to a separate MLP boundary
    assert "model.layers.0.mlp.shared_expert" not in p
    assert contract(p["model.layers.0.self_attn"])["_needs_cp_attn"] is True
    assert "model.layers.0" in p  # SP layer boundary


def test_qwen2moe_ep2_shards_batched_experts_on_ep():
    p = plan(meta("qwen2moe"), "tp=2", ep_size=2)
    assert p.ep_size == 2
    expected = {k: L(tp="replicate") for k in QWEN_MOE_PARAMS}
    expected["experts.gate_up_proj"] = L(ep="shard(0)")
    expected["experts.down_proj"] = L(ep="shard(0)")
    for i in range(2):
        assert contract(p[f"model.layers.{i}.mlp"]) == moe_contract(expected, ep_size=2)
    # attention and the rest are unaffected by EP
    assert (
        p["model.layers.0.self_attn"] == plan(meta("qwen2moe"), "tp=2")["model.layers.0.self_attn"]
    )


def test_qwen2moe_ep_without_sequence_parallel_keeps_tokens_replicated():
    p = plan(meta("qwen2moe"), "tp=2", ep_size=2, sequence_parallel=False)
    spec = contract(p["model.layers.0.mlp"])
    assert spec["in_src"] == spec["in_dst"] == {"hidden_states": L(tp="replicate")}
    assert spec["region_dispatch"] is False


def test_mixtral_ep2_with_cp():
    p = plan(meta("mixtral"), "tp=2,cp=2", ep_size=2)
    between = L(cp="shard(1)", tp="shard(1)")
    assert contract(p["model.layers.1.mlp"]) == moe_contract(
        {
            "gate.weight": L(cp="replicate", tp="replicate"),
            "experts.gate_up_proj": L(ep="shard(0)"),
            "experts.down_proj": L(ep="shard(0)"),
        },
        ep_size=2,
        between=between,
    )


def test_per_expert_modulelist_is_stacked_under_one_name():
    p = plan(list_moe_lm(), "tp=2", ep_size=2)
    stacked = {
        f"experts.{w}.weight": [f"experts.{i}.{w}.weight" for i in range(4)]
        for w in ("w1", "w2", "w3")
    }
    assert contract(p["model.layers.0.block_sparse_moe"]) == moe_contract(
        {
            "gate.weight": L(tp="replicate"),
            "experts.w1.weight": L(ep="shard(0)"),
            "experts.w2.weight": L(ep="shard(0)"),
            "experts.w3.weight": L(ep="shard(0)"),
        },
        ep_size=2,
        stack=stacked,
    )


def test_per_expert_modulelist_without_ep_keeps_each_expert_whole():
    p = plan(list_moe_lm(), "tp=2")
    params = contract(p["model.layers.1.block_sparse_moe"])["params"]
    assert params["experts.3.w2.weight"] == L(tp="replicate")
    assert len(params) == 1 + 4 * 3
    assert p["model.layers.1.block_sparse_moe"]._ep_stack == {}


def test_expert_count_must_divide_by_ep():
    with pytest.raises(DivisibilityError) as exc:
        plan(list_moe_lm(experts=3), "tp=2", ep_size=2)
    msg = str(exc.value)
    assert msg.startswith("model.layers.0.block_sparse_moe.params.experts.w1.weight.ep: ")
    assert "shape (3, 32, 64) has size 3, which ep=2 does not divide" in msg
    with pytest.raises(
        DivisibilityError, match=r"experts.gate_up_proj.ep: dim 0 of shape \(4, 64, 64\).*ep=3"
    ):
        plan(meta("qwen2moe"), "tp=2", ep_size=3)


def test_ep_placements_outside_a_moe_block_need_the_axis():
    with pytest.raises(MeshAxisError) as exc:
        plan(
            meta("qwen2moe"),
            "tp=2",
            ep_size=2,
            overrides=[{"match": "model.norm", "params": {"weight": {"ep": "shard(0)"}}}],
        )
    assert str(exc.value).startswith(
        "model.norm.params.weight: axis 'ep' is not a dimension of the mesh tp=2."
    )


@pytest.mark.parametrize(
    ("family", "factory"),
    [("qwen2moe", "qwen2moe"), ("mixtral", "mixtral")],
)
def test_expert_parallel_compute_comes_from_the_architecture(family, factory, monkeypatch):
    """ep > 1 with no override: the compute the installed hp-plugin-moe registers for the
    architecture is planned; without a plugin registering one, none is (preflight refuses)."""
    from hp_core.plugins import reset_plugins

    monkeypatch.delenv("HP_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("HP_PLUGINS", raising=False)
    reset_plugins()
    try:
        moe = {f: s for f, s in plan(meta(family), "tp=2", ep_size=2).items() if s._ep_size > 1}
        assert moe and all(s.local_compute_fn == factory for s in moe.values())
        assert plan(meta(family), "tp=2")["model.layers.0.mlp"].local_compute_fn is None
        monkeypatch.setenv("HP_PLUGINS", "cp")
        reset_plugins()
        unplugged = plan(meta(family), "tp=2", ep_size=2)
        assert all(s.local_compute_fn is None for _, s in unplugged.items() if s._ep_size > 1)
    finally:
        reset_plugins()
