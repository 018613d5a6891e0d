"""Rank-side tasks for tests/test_sdpa_strategies.py (importable by the spawned ranks).

Each case runs the CPU flash kernel through ``F.scaled_dot_product_attention`` twice on
every rank: on the whole seeded tensors (the reference), and on DTensors placed as the case
says; it returns how far the gathered output and the q/k/v gradients are from the
reference, the placements DTensor chose, how many collectives forward and backward issued,
and the ops that ran on DTensors (so a case that silently took the math path shows up).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.experimental import register_sharding
from torch.utils._python_dispatch import TorchDispatchMode

from hp_core.runtime.dtensor_strategies import FLASH_CPU, register_missing_strategies

B, H, L, D = 2, 4, 8, 8
PLACEMENTS: dict[str, Placement] = {"R": Replicate(), "H": Shard(1), "B": Shard(0), "L": Shard(2)}


class DTensorOps(TorchDispatchMode):
    """Records the ops called with a DTensor argument (the DTensor-level view of a call)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(isinstance(a, DTensor) for a in (*args, *(kwargs or {}).values())):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _mask(kind: str | None, gen: torch.Generator) -> torch.Tensor | None:
    if kind is None:
        return None
    if kind == "bool2d":  # a random keep-pattern that always keeps the diagonal (no empty row)
        keep = torch.rand(L, L, generator=gen) > 0.4
        return keep | torch.eye(L, dtype=torch.bool)
    shape = (1, 1, L, L) if kind == "bcast" else (B, H, L, L)
    return torch.randn(shape, generator=gen)


def _mask_placement(kind: str | None, placement: Placement) -> Placement:
    return placement if kind == "full" else Replicate()  # a full mask is sharded like q


def _case(mesh: Any, case: dict[str, Any]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)  # the same tensors on every rank
    heads, kv = case.get("q_heads", H), case.get("kv_heads", H)
    q = torch.randn(B, heads, L, D, generator=gen)
    k, v = torch.randn(B, kv, L, D, generator=gen), torch.randn(B, kv, L, D, generator=gen)
    grad = torch.randn(B, heads, L, D, generator=gen)
    mask = _mask(case.get("mask"), gen)
    kw = {"is_causal": case.get("causal", False), "enable_gqa": kv != heads}
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*ref, attn_mask=mask, **kw)
    ref_out.backward(grad)

    p = PLACEMENTS[case["placement"]]
    dts = [distribute_tensor(t, mesh, [p]).requires_grad_(True) for t in (q, k, v)]
    dmask = None
    if mask is not None:
        dmask = distribute_tensor(mask, mesh, [_mask_placement(case.get("mask"), p)])
    with CommDebugMode() as fwd_comm, DTensorOps() as ops:
        out = F.scaled_dot_product_attention(*dts, attn_mask=dmask, **kw)
    dgrad = distribute_tensor(grad, mesh, list(out.placements))
    with CommDebugMode() as bwd_comm, DTensorOps() as bwd_ops:
        out.backward(dgrad)
    pairs = [(out, ref_out), *((d.grad, r.grad) for d, r in zip(dts, ref, strict=True))]
    diffs = [(a.full_tensor() - b).abs().max().item() for a, b in pairs]  # type: ignore[union-attr]
    return {
        "diff": max(diffs),
        "out": tuple(out.placements),
        "grads": [tuple(d.grad.placements) for d in dts],  # type: ignore[union-attr]
        "comms": fwd_comm.get_total_counts() + bwd_comm.get_total_counts(),
        "ops": ops.seen + bwd_ops.seen,
    }


def run_cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every case on a 1-D tp mesh of this world, after registering hp's strategies."""
    register_missing_strategies()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return [_case(mesh, case) for case in cases]


def _sequence_sharded(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> list[Any]:
    """A wrong strategy: it claims the kernel may split the sequence (each rank would attend
    only within its own chunk of keys)."""
    inputs = [Shard(2)] * 3 + ([Replicate()] if kwargs.get("attn_mask") is not None else [])
    return [([Replicate(), Replicate()], [Replicate()] * len(inputs)), ([Shard(2)] * 2, inputs)]


def run_with_a_wrong_strategy(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``run_cases`` with the forward's strategy swapped for ``_sequence_sharded``; hp's own is
    put back (and DTensor's decisions forgotten) afterwards, as the world is shared."""
    register_missing_strategies()
    prop = DTensor._op_dispatcher.sharding_propagator
    saved = prop.op_strategy_funcs[FLASH_CPU], prop.op_to_schema_info[FLASH_CPU]
    try:
        register_sharding(FLASH_CPU)(_sequence_sharded)
        prop.propagate_op_sharding.cache_clear()
        return run_cases(cases)
    finally:
        prop.op_strategy_funcs[FLASH_CPU], prop.op_to_schema_info[FLASH_CPU] = saved
        prop.propagate_op_sharding.cache_clear()
