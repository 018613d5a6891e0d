"""Tensors that cross a boundary without a declared layout, in-process on meta-device models.

Production gives an undeclared input or output no transition: its gradient goes back as the
code on the other side made it. The planner declares what it can see (one tensor given as
several inputs, a list returned where most return a tuple) and the verifier refuses what it
cannot prove: an undeclared input whose gradient is partial, a gradient sent back into an
undeclared output by code that runs on sequence shards, a declared output that is no tensor.
The distributed matrix (test_matrix.py: ctrl, openai-gpt, gpt_neox_japanese) checks that
what is accepted matches one device.
"""

from __future__ import annotations

from unittest import mock

import pytest
from torch.distributed.tensor import Replicate

from hp_core import plan, verify
from hp_core.plans.fixes import keep_whole
from hp_core.plans.overrides import OverrideEntry
from hp_core.runtime.errors import OutputNotATensorError
from hp_core.runtime.layouts import Redistribution
from hp_core.testing.families import build_family
from hp_core.testing.printed_fix import printed_fix
from hp_core.verifier import InputGradientError, VerificationError

ATTN = "transformer.h.0.multi_head_attention"


def meta(family: str):
    return build_family(family, device="meta")


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_one_tensor_given_as_several_inputs_is_declared_under_each_name(sp):
    """CTRL calls its attention ``(normed, normed, normed, mask)`` for ``(v, k, q, mask)``."""
    m = meta("ctrl")
    spec = plan(m, "tp=2", sequence_parallel=sp)[ATTN]
    assert set(spec.in_src) == set(spec.in_dst) == {"v", "k", "q"}
    assert spec.in_src["v"] == spec.in_src["k"] == spec.in_src["q"]
    verify(m, plan(m, "tp=2", sequence_parallel=sp))


def test_production_converts_a_tensor_given_as_several_inputs_once():
    """One all-gather (and one gradient reduce-scatter) for v, k and q, not three."""
    m = meta("ctrl")
    p = plan(m, "tp=2", sequence_parallel=True)
    calls: list[str] = []
    real = Redistribution.local

    def spy(self, x):
        calls.append(self.where)
        return real(self, x)

    with mock.patch.object(Redistribution, "local", spy):
        verify(m, p)
    entries = [w for w in calls if w.startswith(f"{ATTN} ") and " input " in w]
    assert len(entries) == 1, entries


@pytest.mark.parametrize("local", [False, True], ids=["dispatching", "local-region"])
def test_an_undeclared_input_with_a_partial_gradient_is_refused_with_a_fix_that_verifies(local):
    """The plan before the planner declared k and q: their gradient (through the sharded Wk,
    Wq) is partial, production would hand it back unsummed. A dispatching region shows it in
    DTensor's backward; a local region by the contract's rule."""
    m = meta("ctrl")
    only_v = {"v": {"tp": Replicate()}}
    entry = {"match": "transformer.h.*.multi_head_attention", "in_src": only_v, "in_dst": only_v}
    if local:
        entry["region_dispatch"] = False
    p = plan(m, "tp=2", sequence_parallel=False, overrides=[entry])
    assert set(p[ATTN].in_src) == {"v"}  # the override replaced the declaration
    with pytest.raises(
        InputGradientError, match=r"multi_head_attention: .*'k' \(partial on 'tp'\)"
    ) as e:
        verify(m, p)
    message = str(e.value)
    assert "'q' (partial on 'tp')" in message
    fix = printed_fix(message)
    assert fix is not None and fix.overrides, message
    declared = plan(m, "tp=2", sequence_parallel=False, overrides=[entry, *fix.overrides])
    assert set(declared[ATTN].in_src) == {"v", "k", "q"}
    verify(m, declared)


def _whole_attention(m) -> list[OverrideEntry]:
    """Every layer's attention kept whole on tp (the fix hp prints for it without SP)."""
    p = plan(m, "tp=2", sequence_parallel=False)
    return [
        OverrideEntry(f, keep_whole(p[f]))
        for f in p.modules
        if f.endswith(".attention") and ".layers." in f
    ]


def test_a_gradient_sent_back_into_an_undeclared_output_under_sp_is_refused():
    """GPT-NeoX-Japanese's last attention returns its dense bias; the layer adds it to the
    (sequence-sharded) residual. Its gradient then covers this rank's tokens only."""
    m = meta("gpt_neox_japanese")
    whole = _whole_attention(m)
    with pytest.raises(VerificationError, match="sends a gradient back into them") as e:
        verify(m, plan(m, "tp=2", sequence_parallel=True, overrides=whole))
    assert "layers.1.attention: the model's own code takes its output(s) 'returned item 2'" in str(
        e.value
    )
    fix = printed_fix(str(e.value))
    assert fix is not None and fix.flags == {"sequence_parallel": False}, str(e.value)
    verify(m, plan(m, "tp=2", sequence_parallel=False, overrides=whole))  # without SP: whole


def test_without_tp_ranks_sequence_parallel_shards_nothing_and_nothing_escapes():
    """An ep-only mesh (or tp of one rank) with the default sequence_parallel=True: every rank
    sees all tokens, so the gradient sent back into the dense bias is whole (the MoE plugin's
    dp x ep runs were refused by this check before it looked at the tp size)."""
    m = meta("gpt_neox_japanese")
    whole = _whole_attention(m)
    verify(m, plan(m, "dp=2,tp=1", sequence_parallel=True, overrides=whole))


def test_a_block_that_returns_a_list_has_its_outputs_named_like_a_tuple():
    """GPT-1's attention returns ``[a]`` (a list): its first item is the declared output."""
    m = meta("openai-gpt")
    spec = plan(m, "tp=2", sequence_parallel=False)["transformer.h.0.attn"]
    assert spec.out_names == ["attn_output", "attn_weights"]
    verify(m, plan(m, "tp=2", sequence_parallel=False))


def test_a_declared_output_that_is_not_a_tensor_is_refused():
    """Declared as one output, the list would pass its partial sum on unreduced."""
    m = meta("openai-gpt")
    one = {
        "match": "transformer.h.*.attn",
        "out_names": ["output"],
        "out_src": {"output": {"tp": "partial"}},
        "out_dst": {"output": {"tp": "replicate"}},
    }
    with pytest.raises(
        OutputNotATensorError,
        match=r"transformer\.h\.0\.attn \(Attention\): its "
        r"output 'output' is a list, not a tensor",
    ):
        verify(m, plan(m, "tp=2", sequence_parallel=False, overrides=[one]))
