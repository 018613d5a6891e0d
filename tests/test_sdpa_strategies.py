"""DTensor strategies for the CPU flash attention kernel (hp_core/runtime/dtensor_strategies.py).

Three layers of evidence:

* on a fake process group (rank 0's view): the placements DTensor chooses with hp's
  strategies, the logsumexp's layout, the mask rules (a keyword argument DTensor never
  moves), grouped-query attention, the refusals, the sharding-cache key, and that the
  registration is idempotent and leaves torch's own strategies alone;
* on a real 2-rank gloo world: replicated, heads-sharded and batch-sharded forward and
  backward equal the single-device kernel at 1e-6, with no collective; a deliberately wrong
  strategy (sequence sharding) fails the same check;
* end to end: a torchtitan-layout Llama trained by ``check_equivalence`` at tp=2, with and
  without sequence parallelism, validate mode running the flash kernel on DTensors.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from hp_core.runtime import dtensor_strategies as strategies
from hp_core.runtime.dtensor_strategies import (
    FLASH_CPU,
    FLASH_CPU_BACKWARD,
    AttentionMaskPlacementError,
    has_strategy,
    register_missing_strategies,
)
from hp_core.testing import check_equivalence, get_world
from tests import _sdpa_models as models
from tests import dist_tasks_sdpa as tasks
from tests.test_error_style import style_problems

TOL = 1e-6
PROP = DTensor._op_dispatcher.sharding_propagator
M = "tests._sdpa_models:"


@pytest.fixture
def mesh():
    register_missing_strategies()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def _qkv(mesh, placement, kv_heads=4):
    q = distribute_tensor(torch.randn(2, 4, 8, 8), mesh, [placement])
    kv = [torch.randn(2, kv_heads, 8, 8) for _ in range(2)]
    return q, *(distribute_tensor(t, mesh, [placement]) for t in kv)


def _mask(mesh, shape, placement):
    return distribute_tensor(torch.randn(shape), mesh, [placement])


# ----------------------------------------------------------------- registration


def test_registration_registers_both_kernels_once_and_keys_the_cache_on_the_mask():
    register_missing_strategies()
    ops = (FLASH_CPU, FLASH_CPU_BACKWARD)
    # Forget them (put back only on failure: the new registration is hp's again)
    saved = {op: (PROP.op_strategy_funcs.pop(op), PROP.op_to_schema_info.pop(op)) for op in ops}
    try:
        assert not has_strategy(FLASH_CPU) and not has_strategy(FLASH_CPU_BACKWARD)
        assert register_missing_strategies() == ops
        fn = PROP.op_strategy_funcs[FLASH_CPU]
        assert register_missing_strategies() == ()  # idempotent
        assert PROP.op_strategy_funcs[FLASH_CPU] is fn
        for op in ops:
            assert PROP.op_to_schema_info[op].static_kwargkey == ["attn_mask"]
    except BaseException:
        for op, (fn, info) in saved.items():
            PROP.op_strategy_funcs[op], PROP.op_to_schema_info[op] = fn, info
        raise


def test_an_op_torch_has_a_strategy_for_is_left_alone(monkeypatch):
    cuda_flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    torchs = PROP.op_strategy_funcs[cuda_flash]
    assert has_strategy(cuda_flash)
    monkeypatch.setattr(strategies, "_STRATEGIES", ((cuda_flash, strategies._flash_cpu),))
    assert register_missing_strategies() == ()
    assert PROP.op_strategy_funcs[cuda_flash] is torchs


# ----------------------------------------------------------------- decisions (fake pg)


@pytest.mark.parametrize("placement", [Replicate(), Shard(1), Shard(0)], ids=["R", "heads", "B"])
def test_the_kernel_keeps_q_placement_and_logsumexp_is_b_h_l(mesh, placement):
    q, k, v = _qkv(mesh, placement)
    out, lse = FLASH_CPU(q, k, v, 0.0, True)
    assert out.placements == lse.placements == (placement,)
    assert lse.shape == (2, 4, 8)  # [B, H, L]: heads on dim 1, batch on dim 0, like q
    assert (
        lse.to_local().shape
        == {Replicate(): (2, 4, 8), Shard(1): (2, 2, 8), Shard(0): (1, 4, 8)}[placement]
    )


@pytest.mark.parametrize(
    "shape,mask_placement,expected",
    [
        ((1, 1, 8, 8), Replicate(), Shard(1)),  # broadcast over heads: replicated, heads kept
        ((8, 8), Replicate(), Shard(1)),
        ((2, 4, 8, 8), Shard(1), Shard(1)),  # full heads: sharded like q
        ((4, 8, 8), Shard(0), Shard(1)),  # a 3-D mask has its heads on dim 0
        ((2, 4, 8, 8), Replicate(), Replicate()),  # would have to move: q is gathered instead
    ],
    ids=["bcast", "2d", "full-sharded", "3d-sharded", "full-replicated"],
)
def test_a_mask_is_taken_only_where_it_already_is(mesh, shape, mask_placement, expected):
    q, k, v = _qkv(mesh, Shard(1))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(mesh, shape, mask_placement))
    assert out.placements == (expected,)


def test_batch_sharding_takes_a_batch_sharded_mask_and_keeps_a_broadcast_one(mesh):
    q, k, v = _qkv(mesh, Shard(0))
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(mesh, (2, 4, 8, 8), Shard(0)))
    bcast = F.scaled_dot_product_attention(
        q, k, v, attn_mask=_mask(mesh, (1, 4, 8, 8), Replicate())
    )
    assert full.placements == bcast.placements == (Shard(0),)


def test_a_mask_no_strategy_keeps_is_refused_naming_the_kernel(mesh):
    q, k, v = _qkv(mesh, Shard(1))
    with pytest.raises(AttentionMaskPlacementError) as err:
        F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(mesh, (2, 4, 8, 8), Shard(2)))
    assert "S(2)" in str(err.value)
    assert not style_problems(str(err.value), str(FLASH_CPU))


def test_a_mask_placed_differently_on_two_mesh_dimensions_is_refused():
    register_missing_strategies()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "cp"))
        q = distribute_tensor(torch.randn(2, 4, 8, 8), mesh, [Shard(1), Replicate()])
        mask = distribute_tensor(torch.randn(2, 4, 8, 8), mesh, [Shard(1), Replicate()])
        with pytest.raises(AttentionMaskPlacementError) as err:
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    finally:
        dist.destroy_process_group()
    assert not style_problems(str(err.value), str(FLASH_CPU))


def test_grouped_query_heads_are_sharded_only_in_whole_groups(mesh):
    q, k, v = _qkv(mesh, Shard(1), kv_heads=2)  # 4 q heads on 2 k/v heads: one group per rank
    sharded = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    # 6 q heads on 3 k/v heads: shards of 3 and 3 q heads but 2 and 1 k/v heads, so rank 0
    # would pair its q heads with the wrong k/v heads; DTensor gathers instead.
    q = distribute_tensor(torch.randn(2, 6, 8, 8), mesh, [Shard(1)])
    k, v = (distribute_tensor(torch.randn(2, 3, 8, 8), mesh, [Shard(1)]) for _ in range(2))
    gathered = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert sharded.placements == (Shard(1),)
    assert gathered.placements == (Replicate(),)


def test_the_sharding_cache_tells_calls_with_different_masks_apart(mesh):
    q, k, v = _qkv(mesh, Shard(1))
    assert F.scaled_dot_product_attention(q, k, v).placements == (Shard(1),)
    full = _mask(mesh, (2, 4, 8, 8), Replicate())
    assert F.scaled_dot_product_attention(q, k, v, attn_mask=full).placements == (Replicate(),)
    # Negative control: keyed as register_sharding keys it, the masked call reuses the
    # unmasked decision, and the kernel gets a whole mask for half the heads.
    info = PROP.op_to_schema_info[FLASH_CPU]
    PROP.op_to_schema_info[FLASH_CPU] = type(info)(info.static_argnum, None, info.needs_pytree)
    PROP.propagate_op_sharding.cache_clear()
    try:
        F.scaled_dot_product_attention(q, k, v)
        with pytest.raises(RuntimeError):
            F.scaled_dot_product_attention(q, k, v, attn_mask=full)
    finally:
        PROP.op_to_schema_info[FLASH_CPU] = info
        PROP.propagate_op_sharding.cache_clear()


def test_the_flash_spy_raises_when_the_kernel_did_not_run_on_dtensors():
    spy = models.FlashSpy(F.scaled_dot_product_attention)
    with pytest.raises(RuntimeError, match="did not run on DTensors"):
        spy(*(torch.randn(1, 2, 4, 8) for _ in range(3)))  # plain tensors


# ----------------------------------------------------------------- values (gloo, 2 ranks)


def _check_case(case, result):
    assert result["diff"] <= TOL, f"{case}: off the single-device kernel by {result['diff']}"
    p = tasks.PLACEMENTS[case["placement"]]
    assert result["out"] == (p,), f"{case}: output placed {result['out']}"
    assert all(g == (p,) for g in result["grads"]), f"{case}: gradients placed {result['grads']}"
    assert result["comms"] == 0, f"{case}: {result['comms']} collectives (a redistribution)"
    assert str(FLASH_CPU) in result["ops"] and str(FLASH_CPU_BACKWARD) in result["ops"], case


def _world_results(cases, wrong_strategy=False):
    task = tasks.run_with_a_wrong_strategy if wrong_strategy else tasks.run_cases
    return get_world(2).run(task, cases)


CASES = [
    *({"placement": p, "causal": c} for p in "RHB" for c in (True, False)),
    *({"placement": p, "mask": m} for p in "RHB" for m in ("bcast", "full", "bool2d")),
    *({"placement": p, "causal": True, "kv_heads": 2} for p in "RHB"),
]


#: 6 q heads on 3 k/v heads cannot be split in whole groups over 2 ranks: DTensor gathers.
GATHERED = {"placement": "H", "causal": True, "q_heads": 6, "kv_heads": 3}


@pytest.mark.distributed
def test_sharded_forward_and_backward_equal_the_single_device_kernel():
    for rank_results in _world_results([*CASES, GATHERED]):
        for case, result in zip(CASES, rank_results, strict=False):
            _check_case(case, result)
        gathered = rank_results[-1]
        assert gathered["diff"] <= TOL and gathered["out"] == (Replicate(),), gathered


@pytest.mark.distributed
def test_a_wrong_sequence_sharding_strategy_fails_the_same_check():
    wrong = [{"placement": "L", "causal": True}, {"placement": "L"}]
    for rank_results in _world_results(wrong, wrong_strategy=True):
        for case, result in zip(wrong, rank_results, strict=True):
            assert result["out"] == (Shard(2),)  # the wrong strategy was the one used
            with pytest.raises(AssertionError, match="off the single-device kernel"):
                _check_case(case, result)


# ----------------------------------------------------------------- end to end


@pytest.mark.distributed
@pytest.mark.parametrize(
    "factory,sp",
    [("llama", True), ("llama", False), ("llama_gqa", True)],
    ids=["sp", "no-sp", "gqa-sp"],
)
def test_titan_llama_with_sdpa_matches_one_device_in_both_modes(factory, sp):
    report = check_equivalence(
        M + factory,
        models.batch,
        "tp=2",
        plan_kwargs={"sequence_parallel": sp},
        loss_fn=models.next_token_loss,
        after_apply=models.require_flash_on_dtensors,
        steps=1,
    )
    assert report.passed, report.summary()


def test_validate_keeps_to_the_math_kernel_off_cpu() -> None:
    """CPU: the default kernel (hp's strategies cover it); elsewhere: math only."""
    with strategies.validate_attention_kernels(SimpleNamespace(device_type="cpu")):
        assert torch.backends.cuda.flash_sdp_enabled()
    with strategies.validate_attention_kernels(SimpleNamespace(device_type="cuda")):
        assert not torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()
