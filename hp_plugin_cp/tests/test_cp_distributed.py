"""CP on real gloo ranks: sharded == single device, production == validate, exact collectives.

World 2 runs cp=2; world 4 runs cp=2 x tp=2 (mesh names ("cp", "tp"): cp outer, so a tp
all-gather along the sequence stays inside each cp chunk). Each task bundles several
cases (padding mask on/off x contiguous/load-balanced layout) to keep the worlds busy.
"""

from __future__ import annotations

import textwrap

import _cp_rank_tasks as tasks
import pytest
import yaml

from hp_core.testing import get_world
from hp_core.testing.compare import nan_safe_max

pytestmark = pytest.mark.distributed
TOL = 1e-5
#: (padding mask, load-balanced layout)
CASES = [(False, False), (True, False), (False, True), (True, True)]
MESHES = {"cp2": (2, (2,), ("cp",)), "cp2xtp2": (4, (2, 2), ("cp", "tp"))}


def _check(result: dict, cases: int = len(CASES)) -> None:
    numbers = {k: v for k, v in result.items() if isinstance(v, float)}
    assert len(numbers) == cases * 9  # loss/logits/grad x (prod-ref, val-ref, prod-val)
    bad = {k: v for k, v in numbers.items() if not v <= TOL}  # NaN-safe: a NaN is a mismatch
    assert not bad, f"mismatches above {TOL}: {bad}"


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sdpa_hf_matches_single_device(family, mesh):
    world, shape, names = MESHES[mesh]
    for r in get_world(world).run(tasks.hf_equivalence, family, shape, names, CASES):
        _check(r)
        assert r["applied"] == ["sdpa_hf"]
        assert r["pad-lb:n_grads"] == (27 if family == "qwen2" else 21)


def test_sdpa_qkv_on_an_attention_core_matches_single_device():
    for r in get_world(2).run(tasks.qkv_equivalence, CASES):
        _check(r)
        assert r["mask-lb:production:resolved"] == "layers.0.self_attn.core"


@pytest.fixture(scope="module")
def flex() -> dict:
    return get_world(2).run(tasks.flex_checks)[0]


def test_flex_forward_matches_single_device(flex):
    assert flex["hf-pad-lb:production"] < TOL
    assert flex["hf-pad-lb:validate"] < TOL
    assert flex["qkv:production"] < TOL


@pytest.mark.parametrize("kind", ["hf", "qkv"])
def test_flex_backward_on_cpu_is_a_clear_error(flex, kind):
    msg = flex[f"{kind}-backward"]
    assert msg.startswith("CPUnsupportedError: flex_")
    assert "FlexAttention does not support backward on CPU" in msg  # torch's own words
    assert "sdpa_hf / sdpa_qkv" in msg and "torch.no_grad()" in msg


def _per_layer(one: dict, two: dict, phase: str) -> dict:
    ops = set(one[phase]) | set(two[phase])
    diff = {op: two[phase].get(op, 0) - one[phase].get(op, 0) for op in ops}
    return {op: n for op, n in diff.items() if n}


def _minus(measured: dict, predicted: dict) -> dict:
    ops = set(measured) | set(predicted)
    return {op: n for op in ops if (n := measured.get(op, 0) - predicted.get(op, 0))}


@pytest.mark.parametrize("mode", ["production", "validate"])
@pytest.mark.parametrize(
    ("mesh", "fwd", "bwd"),
    [
        ("cp2", {"all_gather": 1}, {"reduce_scatter": 1}),
        # tp under SP: 2 all-gather + 2 reduce-scatter per layer each way; cp adds its one
        ("cp2xtp2", {"all_gather": 3, "reduce_scatter": 2}, {"all_gather": 2, "reduce_scatter": 3}),
    ],
)
def test_collectives_per_attention_layer(mesh, fwd, bwd, mode):
    world, shape, names = MESHES[mesh]
    w = get_world(world)
    one, two = (w.run(tasks.count_collectives, shape, names, mode, n)[0] for n in (1, 2))
    assert _per_layer(one, two, "forward") == fwd
    assert _per_layer(one, two, "backward") == bwd
    for layers, r in ((1, one), (2, two)):
        # the tp collectives are exactly the plan's; CP adds one packed K/V gather per layer
        assert _minus(r["forward"], r["pred_forward"]) == {"all_gather": layers}
        assert _minus(r["backward"], r["pred_backward"]) == {"reduce_scatter": layers}


@pytest.fixture(scope="module")
def refusals() -> dict:
    return get_world(2).run(tasks.preflight_errors)[0]


def test_attention_without_wrapper_under_cp_gets_pasteable_yaml(refusals):
    msg = refusals["no_wrapper"]
    assert msg.startswith("PreflightError: model.layers.0.self_attn: attention under cp=2")
    assert "hp-plugin-cp" in msg
    pasted = yaml.safe_load(textwrap.dedent(msg[msg.index("  - match") :]))
    assert pasted == yaml.safe_load(tasks.doc_yaml())  # the same override docs/cp.md shows


def test_cp_wrapper_without_cp_axis(refusals):
    assert refusals["no_cp_axis"].startswith(
        "PreflightError: model.layers.0.self_attn: inner wrapper 'sdpa_hf'"
    )
    assert "no active cp axis" in refusals["no_cp_axis"] and "when: cp" in refusals["no_cp_axis"]
    # A callable, not a registry name: caught when the install binds it, so every rank rolls
    # back and raises ApplyFailedError naming the wrapper's own error.
    direct = refusals["no_cp_axis_direct_callable"]
    assert direct.startswith(
        "ApplyFailedError: apply() failed on rank 0 in phase 'boundaries at "
        "model.layers.0.self_attn'"
    ), direct
    assert "CPConfigError: sdpa_hf on 'model.layers.0.self_attn' (LlamaAttention)" in direct, direct
    assert refusals["when_cp_skipped_on_tp"] == "no error"


def test_region_dispatch_must_be_false(refusals):
    assert (
        "requires region_dispatch: false (it communicates); the plan has True"
        in refusals["region_dispatch_true"]
    )


def test_inner_target_and_wrapper_come_in_pairs(refusals):
    assert "inner_target is set but inner_wrapper is not" in refusals["target_without_wrapper"]
    assert "inner_wrapper is set but inner_target is not" in refusals["wrapper_without_target"]


def test_child_target_needs_inner_out_src(refusals):
    msg = refusals["child_without_inner_out_src"]
    assert msg.startswith("PreflightError: layers.0.self_attn: inner_target 'core' is a child")
    assert "inner_out_src" in msg


def test_unknown_wrapper_lists_known_ones_and_providers(refusals):
    msg = refusals["unknown_name"]
    assert "unknown inner wrapper 'sdpa_hff'. Did you mean 'sdpa_hf'?" in msg
    for name in ("sdpa_qkv", "sdpa_hf", "flex_qkv", "flex_hf"):
        assert f"{name} (plugin 'cp' (hp-plugin-cp 0.1.0))" in msg


def test_without_the_plugin_a_cp_plan_names_the_distribution(refusals):
    # Installed but not loaded: the distribution is named from its hp_core.items metadata.
    assert "declared by the installed distribution hp-plugin-cp" in refusals["plugin_absent"]
    assert refusals["plugin_absent_model_untouched"] == "True"


def test_misfire_names_the_module_and_the_fix(refusals):
    msg = refusals["misfire_eager"]
    assert msg.startswith("CPMisfireError: sdpa_hf on 'model.layers.0.self_attn' (LlamaAttention)")
    assert "attn_implementation is 'eager'" in msg and "attn_implementation='sdpa'" in msg


@pytest.fixture(scope="module")
def runtime_errors() -> dict:
    return get_world(2).run(tasks.wrapper_errors)[0]


@pytest.mark.parametrize(
    ("case", "start", "words"),
    [
        ("local_mask_without_layout", "CPMaskError", "computed from the local chunk"),
        (
            "wrong_rank_layout",
            "CPBatchError",
            "sharded for cp rank 1 of 2, but this rank is 0 of 2",
        ),
        ("not_a_layout", "CPBatchError", "must be a CPLayout"),
        (
            "length_mismatch",
            "CPBatchError",
            "sees 8 local positions but the batch was sharded into chunks of 16",
        ),
        ("kv_cache", "CPUnsupportedError", "use_cache=False"),
        (
            "config_layout_mismatch",
            "CPBatchError",
            "load_balanced: true but the batch was sharded with load_balanced=False",
        ),
        ("lb_odd_local_without_layout", "CPBatchError", "length 10 is not divisible by 4"),
        ("loss_without_shift_labels", "CPBatchError", "token at every chunk edge loses its label"),
    ],
)
def test_runtime_errors(runtime_errors, case, start, words):
    msg = runtime_errors[case]
    assert msg.startswith(start) and words in msg, msg
    if case in ("wrong_rank_layout", "kv_cache", "local_mask_without_layout"):
        assert "'model.layers.0.self_attn' (LlamaAttention)" in msg


def test_cp_loss_without_global_count_still_equals_single_device(runtime_errors):
    assert runtime_errors["loss_counts_itself"] == "True"
    assert runtime_errors["loss_wrapped_once"] == "True"  # enable_cp_loss is idempotent


@pytest.fixture(scope="module")
def direct() -> dict:
    return get_world(2).run(tasks.direct_wrapper_checks)[0]


def test_directly_bound_wrappers_compute_non_causal_and_flag_driven_attention(direct):
    assert direct["hf_noncausal"] < TOL  # is_causal=False from the caller, mask passed positionally
    assert direct["hf_call_flag"] < TOL  # no is_causal attribute: the SDPA call's flag decides
    assert direct["qkv_noncausal"] < TOL  # config causal=False beats the core's default
    assert direct["qkv_additive_mask"] < TOL  # a global float mask, narrowed to the local rows
    assert direct["qkv_default_extra_ok"] == "no error"


@pytest.mark.parametrize(
    ("case", "start", "words"),
    [
        (
            "hf_unbound_name",
            "CPMaskError: sdpa_hf on LlamaAttention (layer_idx=0)",
            "model-level attention_mask",
        ),
        (
            "hf_inner_mask",
            "CPMaskError: sdpa_hf on MaskingAttention",
            "mask of shape (8, 8) computed from the local chunk",
        ),
        (
            "hf_sliding_window",
            "CPUnsupportedError: sdpa_hf on SlidingAttention",
            "sliding_window=4",
        ),
        (
            "hf_flex_block_mask",
            "CPMaskError: flex_hf on FlexMaskAttention",
            "computed from the local chunk",
        ),
        (
            "qkv_two_args",
            "CPConfigError: sdpa_qkv on TwoArgCore",
            "must be called as (q, k, v, ...)",
        ),
        ("qkv_extra_arg", "CPUnsupportedError: sdpa_qkv on ExtraArgCore", "argument 'temperature'"),
        ("qkv_extra_tensor_arg", "CPUnsupportedError: sdpa_qkv on ExtraArgCore", "argument 'tag'"),
        (
            "qkv_extra_incomparable_arg",
            "CPUnsupportedError: sdpa_qkv on ExtraArgCore",
            "argument 'tag'",
        ),
        ("flex_qkv_block_mask", "CPUnsupportedError: flex_qkv on FlexCore", "pass block_mask=None"),
    ],
)
def test_directly_bound_wrappers_refuse_what_they_cannot_honour(direct, case, start, words):
    assert direct[case].startswith(start) and words in direct[case], direct[case]


@pytest.mark.parametrize("mesh", list(MESHES))
def test_doc_training_loop_tracks_single_device_adamw(mesh):
    """docs/cp.md's parallelize + train_step, as written: 3 AdamW steps (padding, load balance)."""
    world, shape, names = MESHES[mesh]
    for r in get_world(world).run(tasks.doc_training, shape, names):
        assert r["worst"] < TOL, r["losses"]
        # The optimizer really stepped: every step moved every weight that had a gradient,
        # on every rank, in the CP model and the reference (not: "the losses differ").
        assert r["steps"] == {"cp": 3, "ref": 3}
        assert r["not_stepped"] == {"cp": [], "ref": []}, r["not_stepped"]


def test_cp_loss_wraps_a_vocab_parallel_loss():
    for r in get_world(4).run(tasks.loss_parallel_check):
        assert r.pop("vocab_parallel") == 1.0
        assert set(r) == {"loss", "logits", "grad"} and nan_safe_max(r.values()) < TOL, r
