"""Rank-side tasks for the input checks that run before any collective."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hp_core import apply, plan
from hp_core.testing.families import build_family, family_batch


def _mesh(shape: tuple[int, ...] = (2,), names: tuple[str, ...] = ("tp",)) -> Any:
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _error(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": ""}


def bad_inputs(case: str, mode: str) -> dict[str, Any]:
    """One bad call, then a good one: the model still works after the refusal."""
    m = build_family("llama")
    mesh = _mesh()
    apply(m, plan(m, mesh), mesh, mode=mode)
    rank = dist.get_rank()
    ids = family_batch("llama", seq=16)
    bad = {
        "odd_length": family_batch("llama", seq=15),
        "lengths_differ": family_batch("llama", seq=16 if rank == 0 else 14),
        "dtypes_differ": ids if rank == 0 else ids.int(),
        "values_differ": family_batch("llama", seq=16, seed=rank),
    }[case]
    out = _error(lambda: m(input_ids=bad, labels=bad, use_cache=False))
    good = m(input_ids=ids, labels=ids, use_cache=False)
    good.loss.backward()
    out["then_ok"] = bool(torch.isfinite(good.loss))
    out["checks"] = m._hp_applied.guard.checks
    return out


def generate(sp: bool, mode: str, check_inputs: bool = True) -> dict[str, Any]:
    m = build_family("llama")
    ref = copy.deepcopy(m)
    mesh = _mesh()
    apply(m, plan(m, mesh, sequence_parallel=sp), mesh, mode=mode, check_inputs=check_inputs)
    ids = family_batch("llama", batch=1, seq=8)
    tokens: dict[str, Any] = {}
    out = _error(
        lambda: tokens.update(tokens=m.generate(ids, max_new_tokens=4, do_sample=False).tolist())
    )
    out.update(tokens)
    out["ref"] = ref.generate(ids, max_new_tokens=4, do_sample=False).tolist()
    # HF's default use_cache=True on a plain forward call works in both modes
    loss = m(input_ids=ids, labels=ids).loss
    out["loss_matches"] = abs(float(loss) - float(ref(input_ids=ids, labels=ids).loss)) < 1e-5
    fallback = m._hp_applied.fallback
    out["whole_sequence_forwards"] = fallback.uses if fallback is not None else None
    # training keeps sequence parallelism: an odd length with gradients is still refused
    odd = family_batch("llama", batch=1, seq=7)
    out["training_odd"] = _error(
        lambda: m(input_ids=odd, labels=odd, use_cache=False).loss.backward()
    )["type"]
    return out


def data_parallel_batches_may_differ() -> dict[str, Any]:
    m = build_family("llama")
    ref = copy.deepcopy(m)
    mesh = _mesh((2, 2), ("dp", "tp"))
    apply(m, plan(m, mesh), mesh)
    ids = family_batch("llama", seed=mesh.get_local_rank("dp"))
    loss = m(input_ids=ids, labels=ids, use_cache=False).loss
    return {
        "matches": abs(float(loss) - float(ref(input_ids=ids, labels=ids, use_cache=False).loss))
        < 1e-5
    }


def guard_off() -> dict[str, Any]:
    m = build_family("llama")
    mesh = _mesh()
    apply(m, plan(m, mesh), mesh, check_inputs=False)
    return {"guard": m._hp_applied.guard is None}
