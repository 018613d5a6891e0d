"""Tuple outputs from what the forward returns, and a final norm handed over whole.

GPT-NeoX's and Falcon's attention forwards carry no return annotation: the meta trace sees
them return ``(attn_output, attn_weights)``. GPT-2's and GPTBigCode's base models view the
final norm's output to the whole-sequence shape before the head: under sequence
parallelism that norm gathers on exit and the head reads it whole (still one all-gather).
Falcon's ``mlp_output += attention_output`` updates a boundary output in place, so a
boundary hands out no custom-Function view.
"""

from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from hp_core import plan
from hp_core.planner import infer_roles, structure
from hp_core.planner.templates.roles import DEFAULT_ROLE_RULES
from hp_core.planner.trace import TraceFailedError, trace
from hp_core.plans.prediction import step_collectives
from hp_core.testing import get_world
from hp_core.testing.families import build_family
from tests import dist_tasks_tuple_head as tasks
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("builtin_only")
TOL = 1e-5
ZERO_CONFIG = [(f, sp) for f in ("gpt_neox", "falcon", "gpt2") for sp in (True, False)]


def _matched(r: dict) -> None:
    assert "refused" not in r and "caught" not in r, r
    bad = {k: v for k, v in r["excess"].items() if not v <= TOL}
    assert not bad, f"mismatches above {TOL}: {bad}"
    # prod-ref, val-ref and prod-val each compared loss, logits and every gradient
    assert {k.split(":")[0] for k in r["excess"]} == {"prod-ref", "val-ref", "prod-val"}
    assert r["n_grads"] > 0 and not any(r["unmoved"].values()), r["unmoved"]
    assert r["collectives"] == 0  # verifying issued none


# ----------------------------------------------------------------------- on one process


def test_the_trace_sees_tuples_where_no_annotation_says_so():
    model = build_family("gpt_neox", seed=0)
    attn = model.gpt_neox.layers[0].attention
    assert not structure.returns_tuple(attn)  # no return annotation
    seen = trace(model).tuple_outputs
    assert seen["gpt_neox.layers.0.attention"] and not seen["gpt_neox.layers.0.mlp"]
    p = plan(model, "tp=2", sequence_parallel=False)
    spec = p["gpt_neox.layers.0.attention"]
    assert spec.out_names == ["attn_output", "attn_weights"]
    assert spec.out_src == {"attn_output": {"tp": mock.ANY}}


class _Liar(nn.Module):
    """Annotated to return a tuple; returns one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(8, 8), nn.Linear(8, 8)
        self.v_proj, self.o_proj = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        a = torch.softmax(self.q_proj(x) @ self.k_proj(x).transpose(-1, -2), -1)
        return self.o_proj(a @ self.v_proj(x))  # type: ignore[return-value]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(32, 8)
        self.attn = _Liar()
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 32, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.attn(self.tok(ids))))


def _fail(model: nn.Module, call: object = None) -> None:
    raise TraceFailedError("no meta run here")


def test_what_the_forward_returns_overrules_its_annotation():
    model = _Net()
    assert structure.returns_tuple(model.attn)
    assert plan(model, "tp=2")["attn"].out_names is None
    assert "output" in plan(model, "tp=2")["attn"].out_src
    # where the trace cannot run the annotation decides
    with (
        mock.patch.object(structure, "run_trace", _fail),
        mock.patch.object(infer_roles, "run_trace", _fail),
    ):
        assert plan(model, "tp=2")["attn"].out_names == ["attn_output", "attn_weights"]


class _AdHoc(_Net):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = nn.Identity()(self.tok(ids))  # a module that is not the model's
        return self.head(self.norm(self.attn(x)))


def test_modules_of_no_model_are_not_recorded():
    seen = trace(_AdHoc()).tuple_outputs
    projections = {f"attn.{n}": False for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert seen == {
        "": False,
        "tok": False,
        "attn": False,
        "norm": False,
        "head": False,
        **projections,
    }


@pytest.mark.parametrize("family, config", [("gpt2", {}), ("gpt_bigcode", {"multi_query": False})])
def test_a_final_norm_reshaped_by_model_code_hands_its_output_over_whole(family, config):
    model = build_family(family, seed=0, **config)
    assert trace(model).reshaped_norms == {"transformer.ln_f"}
    p = plan(model, "tp=2")
    assert p["transformer.ln_f"].out_src["output"]["tp"] == Shard(1)
    assert p["transformer.ln_f"].out_dst["output"]["tp"] == Replicate()
    assert p["lm_head"].in_src["input"]["tp"] == Replicate()
    # one all-gather either way: where the head gathered its input, the norm now does. The
    # head's input gradient (partial: the vocabulary is split) is summed by an all-reduce at
    # the head instead of the reduce-scatter of the head's own gather
    with mock.patch.object(structure, "_mark_outputs", lambda blocks, flows: None):
        before = plan(model, "tp=2")
    assert before["lm_head"].in_src["input"]["tp"] == Shard(1)
    now, then = step_collectives(p.modules), step_collectives(before.modules)
    assert {k: v for k, v in now.items() if k[0] == "forward"} == {
        k: v for k, v in then.items() if k[0] == "forward"
    }
    assert now - then == Counter({("backward", "all_reduce", "tp"): 1})
    assert then - now == Counter({("backward", "reduce_scatter", "tp"): 1})
    # without sequence parallelism nothing changes
    nosp = plan(model, "tp=2", sequence_parallel=False)
    assert nosp["transformer.ln_f"].out_dst["output"]["tp"] == Replicate()
    assert nosp["lm_head"].in_src["input"]["tp"] == Replicate()


def test_a_final_norm_no_model_code_reshapes_stays_sequence_sharded():
    model = build_family("llama", seed=0)
    assert trace(model).reshaped_norms == set()
    p = plan(model, "tp=2")
    assert p["model.norm"].out_dst["output"]["tp"] == Shard(1)
    assert p["lm_head"].in_src["input"]["tp"] == Shard(1)


def test_the_light_trace_runs_only_where_the_code_leaves_outputs_unclear():
    llama = build_family("llama", seed=0)
    rules = [*DEFAULT_ROLE_RULES]
    calls = []

    def counted(model: nn.Module, call: object = None) -> object:
        calls.append(type(model).__name__)
        return trace(model)

    with mock.patch.object(structure, "run_trace", counted):
        # annotated attention, no reshape in LlamaModel.forward / the decoder layer: no run
        blocks = structure.analyse(llama, rules).blocks
        assert calls == [] and {b.tuple_out for b in blocks} == {None}
        structure.analyse(build_family("gpt_neox", seed=0), rules)  # no return annotation
        assert calls == ["GPTNeoXForCausalLM"]
        with mock.patch.object(structure.inspect, "getsource", side_effect=OSError):
            structure.analyse(llama, rules)  # no source to read: the trace decides
        assert calls == ["GPTNeoXForCausalLM", "LlamaForCausalLM"]


# ------------------------------------------------------------------------- on tp=2


@pytest.mark.distributed
def test_gpt_neox_falcon_and_gpt2_match_one_device_at_tp2_without_help():
    results = get_world(2).run(tasks.cases, ZERO_CONFIG)
    assert results[0].keys() == {f"{f}/{'sp' if sp else 'nosp'}" for f, sp in ZERO_CONFIG}
    for r in results[0].values():
        _matched(r)


@pytest.mark.distributed
@pytest.mark.parametrize("sp", [True, False])
def test_gpt_bigcode_matches_with_its_multi_query_attention_kept_whole(sp):
    _matched(get_world(2).run(tasks.whole_attention_case, "gpt_bigcode", sp)[0])


@pytest.mark.distributed
def test_without_what_the_trace_saw_the_verifier_refuses():
    items = [("gpt_neox", False), ("falcon", True), ("gpt2", True), ("gpt_bigcode", True)]
    r = get_world(2).run(tasks.cases, items, "no_trace_outputs")[0]
    for key in ("gpt_neox/nosp", "falcon/sp"):  # the tuple itself meets the declared layout
        assert r[key]["type"] == "OutputNotATensorError", r[key]
        assert "is a tuple, not a tensor" in r[key]["message"]
    assert r["gpt2/sp"]["type"] == "LayoutMismatchError"
    assert "lm_head" in r["gpt2/sp"]["message"]
    assert r["gpt_bigcode/sp"]["refused"] == "plan"  # multi-query, before anything else


@pytest.mark.distributed
def test_boundary_outputs_as_views_break_falcons_in_place_add():
    items = [("falcon", False), ("falcon", True)]
    r = get_world(2).run(tasks.cases, items, "to_local_views")[0]
    assert r["falcon/nosp"]["type"] == "UnverifiableError", r
    assert "modified inplace" in r["falcon/nosp"]["message"]
    # under sequence parallelism the layer is a local region: the same in-place add fails in
    # its code on the shards while the unsharded model runs it, so the verifier refuses it
    assert r["falcon/sp"]["type"] == "ProductionDiffersError", r
    assert r["falcon/sp"]["message"].startswith("transformer.h.0 (FalconDecoderLayer)"), r
    assert "modified inplace" in r["falcon/sp"]["message"]


OLD_FALCON = {"new_decoder_architecture": False, "multi_query": False, "num_kv_heads": 4}


@pytest.mark.distributed
@pytest.mark.parametrize("sp", [True, False])
def test_falcons_first_architecture_matches_too(sp):
    """q/k/v interleaved per head (``[heads, 3, head_dim]``), one norm, parallel attention."""
    _matched(get_world(2).run(tasks.variant_case, "falcon", sp, OLD_FALCON)[0])


@pytest.mark.distributed
def test_multi_query_falcon_is_refused_by_design():
    world = get_world(2)
    # the table's falcon: new decoder architecture, 2 kv heads (grouped, not multi-query)
    cfg = build_family("falcon", seed=0).config
    assert cfg.new_decoder_architecture and cfg.num_kv_heads == 2
    mq = world.run(tasks.refusal, "falcon", True, new_decoder_architecture=False, multi_query=True)
    assert mq[0]["type"] == "FusedProjectionError"
    assert "multi-query" in mq[0]["message"]
