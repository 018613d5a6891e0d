"""``ShardingPlan.explain()``: plain, greppable text in model order."""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate

from hp_core import plan
from hp_core.injection import local_compute
from hp_core.plans import PlanError, ShardingPlan
from hp_core.plans.explain import explain
from hp_core.presets import build_model
from hp_core.spec import ModuleShardingSpec
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)
from tests._toy_models import head_attention_lm, list_moe_lm

pytestmark = pytest.mark.usefixtures("builtin_only")


def meta(family: str = "llama", **kw) -> torch.nn.Module:
    return build_model(family, device="meta", **kw)


def section(text: str, fqn: str) -> list[str]:
    """The indented lines under the header line ``fqn``."""
    lines = text.splitlines()
    start = lines.index(fqn) + 1
    out = []
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        out.append(line)
    return out


@local_compute
def tiny_compute(ctx, scale=1.0):  # pragma: no cover - never applied
    return None


def test_sequence_parallel_llama():
    p = plan(meta(attention_bias=True, mlp_bias=True), "tp=2")
    text = p.explain()
    assert text == explain(p)
    assert text.endswith("\n")
    assert "[" not in text.split("override notes")[0]  # no rich markup
    headers = [line for line in text.splitlines() if line and not line.startswith(" ")]
    assert (
        headers[0]
        == "hp plan: mesh tp=2 (2 devices); sequence parallel on; loss parallel off; ep_size 1"
    )
    assert headers[1] == f"13 modules planned (13 boundaries); fingerprint {p.fingerprint()[:16]}"
    assert headers[2:15] == list(p)  # every boundary, in model order
    assert section(text, "model.layers.0.self_attn") == [
        "  params:",
        "    q_proj.weight: {tp: shard(0)}",
        "    q_proj.bias: {tp: shard(0)}",
        "    k_proj.weight: {tp: shard(0)}",
        "    k_proj.bias: {tp: shard(0)}",
        "    v_proj.weight: {tp: shard(0)}",
        "    v_proj.bias: {tp: shard(0)}",
        "    o_proj.weight: {tp: shard(1)}",
        "    o_proj.bias: {tp: replicate}",
        "  in hidden_states: shard(1)→replicate on tp: all_gather (bwd reduce_scatter)",
        "  out attn_output: partial→shard(1) on tp: reduce_scatter (bwd all_gather)",
        "  out names: attn_output, attn_weights",
        "  deferred biases (added once after the exit reduction): o_proj.bias",
    ]
    assert section(text, "model.embed_tokens") == [
        "  params:",
        "    weight: {tp: shard(0)}",
        "  out output: partial→replicate on tp: all_reduce",
    ]
    assert section(text, "model.layers.0") == [
        "  params: none",
        "  in hidden_states: replicate→shard(1) on tp: no communication (bwd all_gather)",
        "  out output: shard(1) on tp: unchanged",
        "  injections: region_dispatch=false",
    ]
    assert section(text, "lm_head")[-3:] == [
        "  in input: shard(1)→replicate on tp: all_gather (bwd reduce_scatter)",
        "  out output: shard(2)→replicate on tp: all_gather",
        "  terminal: its output is the model's logits",
    ]
    tail = text.split("collectives per training step (predicted, one forward + one backward):\n")[1]
    assert tail.splitlines() == [
        "  forward: 12",
        "    all_gather on tp: 6",
        "    all_reduce on tp: 2",
        "    reduce_scatter on tp: 4",
        "  backward: 11",
        "    all_gather on tp: 5",
        "    all_reduce on tp: 1",
        "    reduce_scatter on tp: 5",
        "  (forward all_reduce on tp includes 1 input check: the ranks compare their input shapes "
        "before the first collective; apply(check_inputs=False) drops it)",
        "  (backward all_reduce on tp includes one bucketed reduction of the 9 gradient(s) of "
        "tp-replicated parameters that see only this rank's sequence shard (hp plan --verify "
        "finds any others))",
    ]


def test_with_the_verifier_report_the_reductions_are_exact():
    from hp_core import verify

    m = meta()
    p = plan(m, "tp=2", sequence_parallel=False)
    assert "includes one bucketed reduction" not in p.explain()  # no SP: the contract predicts none
    text = plan(m, "tp=2").explain(verify(m, plan(m, "tp=2")))
    assert (
        "  (backward all_reduce on tp includes one bucketed reduction of the 5 gradient(s) "
        "the verifier found partial over tp)" in text
    )


def test_loss_parallel_counts_the_parallel_cross_entropy():
    text = plan(meta(), "tp=2", loss_parallel=True).explain()
    tail = text.split("collectives per training step (predicted, one forward + one backward):\n")[
        1
    ].splitlines()
    assert tail[:4] == [
        "  forward: 13",
        "    all_gather on tp: 5",
        "    all_reduce on tp: 4",
        "    reduce_scatter on tp: 4",
    ]
    assert (
        "  (forward all_reduce on tp includes the vocab-parallel cross-entropy's 2: the max, "
        "then the sum of exponentials with the target logit)" in tail
    )


def test_without_sequence_parallel_the_grad_all_reduce_shows():
    text = plan(meta(), "tp=2", sequence_parallel=False).explain()
    assert "  in hidden_states: replicate on tp: unchanged (bwd all_reduce)" in section(
        text, "model.layers.1.self_attn"
    )
    assert "  out attn_output: partial→replicate on tp: all_reduce" in section(
        text, "model.layers.1.self_attn"
    )
    assert "bucketed" not in text
    assert len(re.findall(r"^model\.layers\.\d+$", text, re.MULTILINE)) == 0


def test_cp_injections_attrs_and_notes():
    overrides = [
        {
            "match": "model.layers.0.self_attn",
            "inner_wrapper": "sdpa_hf",
            "inner_target": "self",
            "region_dispatch": False,
            "tp_divide_attrs": ["head_dim"],
        },
        {"match": "model.layers.1.self_attn", "inner_out_src": "first_input"},
        {
            "match": "model.layers.0.mlp",
            "local_compute_fn": {"_target_": "my_compute", "capacity": 2},
            "region_dispatch": True,
        },
        {
            "match": "model.layers.1.mlp",
            "local_compute_fn": tiny_compute,
            "region_dispatch": False,
            "inner_out_src": {"tp": "replicate"},
        },
        {
            "match": "model.norm",
            "out_dst": {"y": {"tp": "replicate"}},
            "in_src": {"x": {"tp": "shard(1)"}},
            "in_dst": "none",
        },
        {"match": "model.layers.0.input_layernorm", "in_src": "none"},
    ]
    # Names no plugin registers ('my_compute'): explained, not checked.
    p = plan(head_attention_lm(), "tp=2,cp=2", overrides=overrides, check_items=False)
    text = p.explain()
    assert text.startswith("hp plan: mesh tp=2,cp=2 (4 devices); sequence parallel on;")
    attn0 = section(text, "model.layers.0.self_attn")
    assert "  in hidden_states: shard(1) on cp: unchanged" in attn0
    assert "  injections: inner_wrapper=sdpa_hf, inner_target=self, region_dispatch=false" in attn0
    assert "  attrs (divided by tp): num_heads 4→2, num_key_value_heads 2→1, head_dim 16→8" in attn0
    assert not any("needs a CP inner wrapper" in line for line in attn0)
    attn1 = section(text, "model.layers.1.self_attn")
    assert "  injections: inner_out_src=first_input" in attn1
    assert attn1[-1] == (
        "  attention under cp: needs a CP inner wrapper, none set yet (e.g. inner_wrapper: "
        "sdpa_hf from hp-plugin-cp)"
    )
    assert "  injections: local_compute_fn=my_compute(capacity=2), region_dispatch=true" in section(
        text, "model.layers.0.mlp"
    )
    assert (
        "  injections: local_compute_fn=tests.test_planner_explain.tiny_compute, "
        "inner_out_src={output: {tp: replicate}}, region_dispatch=false"
    ) in section(text, "model.layers.1.mlp")
    norm = section(text, "model.norm")
    assert "  in x: {tp: shard(1)} (no in_dst entry: passed on as is)" in norm
    assert "  out y: → {tp: replicate} (no out_src entry: arrives as is)" in norm
    first_norm = section(text, "model.layers.0.input_layernorm")
    assert "  in x: → {cp: shard(1), tp: shard(1)} (no in_src entry: arrives as is)" in first_norm
    notes = text.split("override notes:\n")[1].splitlines()
    assert notes == [f"  {n}" for n in p.notes] and len(notes) == 3


def test_expert_parallel_stacking_and_non_boundaries():
    p = plan(
        list_moe_lm(1), "tp=2", ep_size=2, overrides=[{"match": "model.norm", "is_boundary": False}]
    )
    text = p.explain()
    moe = section(text, "model.layers.0.block_sparse_moe")
    assert "  expert parallel: ep_size=2 over the derived (edp, ep) expert mesh" in moe
    assert (
        "    stack experts.w2.weight ← experts.0.w2.weight … experts.3.w2.weight (4 experts)" in moe
    )
    assert "    experts.w1.weight: {ep: shard(0)}" in moe
    assert section(text, "model.norm") == [
        "  params:",
        "    weight: {tp: replicate}",
        "  not a boundary: parameters only, forward is not wrapped",
    ]
    assert "8 modules planned (7 boundaries)" in text


def test_hand_made_plans_and_edge_cases():
    # A non-sum partial cannot be declared (UnsupportedPartialError); explain still copes
    # with one that was put there by hand after the spec was built.
    odd = ModuleShardingSpec(
        params={},
        in_src={},
        in_dst={},
        out_src={"o": {"tp": Replicate()}},
        out_dst={"o": {"tp": Replicate()}},
    )
    odd.out_src = {"o": {"tp": Partial("max")}}
    odd_text = explain(ShardingPlan({"head": odd}, ("tp",), (2,)))
    assert "  out o: Partial(max)→replicate on tp: all_reduce" in section(odd_text, "head")
    assert (
        "fingerprint unavailable (modules['head'].out_src.o.tp: placement Partial(max) has "
        "no DSL form" in odd_text
    )
    spec = ModuleShardingSpec(params={}, in_src={}, in_dst={})
    spec._ep_size = 2
    spec._ep_stack = {"experts.w": ["experts.0.w"]}
    p = ShardingPlan({"": spec}, ("ep",))
    text = explain(p)
    assert text.startswith("hp plan: mesh ep; sequence parallel off;")
    assert section(text, "<root>") == [
        "  params: none",
        "  in/out: no layouts declared (nothing is redistributed)",
        "  expert parallel: ep_size=2 over the derived (edp, ep) expert mesh",
        "    stack experts.w ← experts.0.w",
    ]
    assert text.rstrip().endswith(
        "collectives per training step (predicted, one forward + one backward):\n  none"
    )
    with pytest.raises(PlanError, match="explain: expected a ShardingPlan, got dict"):
        explain({})
