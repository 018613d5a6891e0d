"""Models written outside transformers plan with zero configuration and match one device.

Each model of ``hp_core.testing.external_models`` is planned at tp=2 (sequence parallel on
and off) with no override, no plugin and no registered name: loss, logits and every
gradient over 2 AdamW steps match a single device in production and validate mode, and
production matches validate. Fused q/k/v projections (nanoGPT's ``c_attn``, Megatron's
``linear_qkv``) hold no head count anywhere: their layouts and head counts are read off
their forwards (nanoGPT's, which splits by its input's width, sees that width local); a
block whose projections sit beside its residual adds is refused under sequence parallelism.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from hp_core import plan
from hp_core.testing import get_world
from hp_core.testing.external_models import EXTERNAL_MODELS, build_external
from tests import dist_tasks_external as tasks

TOL = 1e-5
MATCH = ["torchtitan_llama", "megatron_split", "own_llama", "tiny_gpt", "flat_gpt"]
FUSED = ["nanogpt", "megatron_fused"]  # planned from what their forwards show
CASES = [(n, sp) for n in [*MATCH, *FUSED] for sp in (True, False)]
#: Refused under sequence parallelism, by the verifier: its block reads the sequence length
#: from its local (sequence-sharded) input, then views a gathered projection's output with it.
REFUSED_UNDER_SP = {"flat_gpt": "LayoutMismatchError"}


def test_the_zoo_is_fully_listed():
    assert set(EXTERNAL_MODELS) == {*MATCH, *FUSED}


@pytest.mark.distributed
def test_external_models_match_one_device_or_are_refused_clearly():
    results = get_world(2).run(tasks.external_cases, CASES)
    for rank_results in results:
        for (name, sp), r in zip(CASES, rank_results, strict=True):
            where = f"{name} (sp={sp})"
            if sp and name in REFUSED_UNDER_SP:
                assert r.get("refused") == REFUSED_UNDER_SP[name], (where, r)
                assert r["message"].startswith("blocks.0."), where
                continue
            assert "refused" not in r, (where, r.get("message", "")[:500])
            bad = {k: v for k, v in r["excess"].items() if not v <= TOL}
            assert not bad, (where, bad)
            assert r["n_grads"] > 0 and not any(r["unmoved"].values()), (where, r["unmoved"])
            assert r["collectives"] == 0, where
            assert {"prod-ref:grad", "val-ref:logits", "prod-val:loss"} <= set(r["excess"])


@pytest.mark.distributed
def test_a_runtime_that_forgets_the_gradient_sums_is_caught():
    """Negative control: the comparison above must be able to fail."""
    for r in get_world(2).run(tasks.external_case, "own_llama", True, "no_reductions"):
        assert r.get("caught") or any(
            v > TOL for k, v in r["excess"].items() if k.endswith(":grad")
        ), r


def test_fused_projections_found_by_the_trace_are_read_off_their_forwards():
    """Megatron's ``linear_qkv`` matches no name rule and no attribute counts its heads: the
    trace sees q and k from one matrix, the proof reads its cuts (``chunk(3)``) and each
    part's view into heads, and nothing needs dividing. nanoGPT's ``c_attn`` splits by its
    input's width, which the proof finds must be read local."""
    megatron = plan(build_external("megatron_fused"), "tp=2")["decoder.layers.0.self_attention"]
    layout = megatron._fused_layouts["linear_qkv.weight"]
    assert (layout["parts"], layout["units"]) == ([64, 64, 64], [4, 4, 4])
    assert megatron._tp_local_attr_plan is None
    nano = plan(build_external("nanogpt"), "tp=2")["transformer.h.0.attn"]
    assert nano._tp_local_attr_plan == {"<input width>": (64, 32)}


class _Mix(nn.Module):
    """The least a layer can be and still need the trace: norm, q/k/v, attention, out."""

    def __init__(self) -> None:
        super().__init__()
        self.n = nn.LayerNorm(32)
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.n(x)
        return x + self.o(F.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h)))


class _Deep(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(_Mix() for _ in range(layers))
        self.out = nn.Linear(32, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _plan_seconds(layers: int) -> float:
    with torch.device("meta"):
        model = _Deep(layers)
    t0 = time.process_time()  # this process's CPU time: other work on the machine does not count
    p = plan(model, "tp=2")
    elapsed = time.process_time() - t0
    assert p[f"blocks.{layers - 1}.o"].params["weight"]["tp"] == Shard(1)  # the trace ran
    return elapsed


def test_planning_stays_linear_in_depth():
    """Planning (the meta trace included) 4x the layers costs about 4x, not 16x."""
    _plan_seconds(8)  # warm caches
    small = _plan_seconds(256)
    large = _plan_seconds(1024)
    assert large / small < 8.0, f"256 layers: {small:.2f}s, 1024 layers: {large:.2f}s"
