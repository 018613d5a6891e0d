"""The whole-sequence variant of a sequence-parallel plan (inference that cannot split)."""

from __future__ import annotations

from hp_core import plan
from hp_core.runtime.sequence import SequenceFallback, whole_sequence_plan
from hp_core.testing.families import build_family


def test_the_variant_is_what_the_planner_derives_without_sequence_parallelism():
    m = build_family("qwen3", device="meta")
    variant = whole_sequence_plan(plan(m, "tp=2"))
    no_sp = plan(m, "tp=2", sequence_parallel=False)
    assert not variant.sequence_parallel
    for fqn, spec in no_sp.items():
        mine = variant[fqn]
        assert (mine.params, mine.in_src, mine.in_dst, mine.out_src, mine.out_dst) == (
            spec.params,
            spec.in_src,
            spec.in_dst,
            spec.out_src,
            spec.out_dst,
        ), fqn
    # the layers keep their (now identity) boundary; the planner without SP has none
    assert set(variant) - set(no_sp) == {"model.layers.0", "model.layers.1"}
    layer = variant["model.layers.1"]
    assert (
        layer.in_src
        == layer.in_dst
        == {"hidden_states": {"tp": no_sp["model.norm"].in_src["hidden_states"]["tp"]}}
    )


def test_the_variant_is_verified_once_when_first_needed():
    calls = []
    fb = SequenceFallback(plan(build_family("llama", device="meta"), "tp=2"), calls.append)
    assert not fb.active and calls == []
    fb.engage()
    fb.engage()
    assert fb.active and fb.uses == 2 and len(calls) == 1 and calls[0] is fb.variant
