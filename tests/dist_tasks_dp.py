"""Rank-side tasks: hp composed with FSDP2 / DDP on the dp axis (world 4: dp=2 x tp=2)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hp_core import apply, plan
from hp_core.testing.compare import (
    GradientCheckError,
    allclose_excess,
    gather_full_grads,
    grads_excess,
    nan_safe_max,
    snapshot_params,
    unmoved_params,
)
from hp_core.testing.families import build_family, family_batch

RTOL = 1e-5


def _wrap(model: Any, wrapper: str, mesh: Any) -> Any:
    if wrapper == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=mesh["dp"].get_group())
    return model


def train(
    wrapper: str,
    sp: bool,
    mode: str = "production",
    family: str = "llama",
    steps: int = 3,
    hp_reduces: bool = True,
) -> dict[str, Any]:
    """3 AdamW steps; each dp replica trains on its own batch; the reference on both at once.

    ``hp_reduces=False`` drops hp's derived reductions (the negative control).
    """
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    base = build_family(family, seed=0)
    ref, par = copy.deepcopy(base), copy.deepcopy(base)
    apply(par, plan(par, mesh, sequence_parallel=sp), mesh, mode=mode)
    inner = par
    if not hp_reduces and par._hp_applied.grad_reducer is not None:
        par._hp_applied.grad_reducer.buckets = []
    par = _wrap(par, wrapper, mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6, foreach=False) for m in (ref, par)]
    dp = mesh.get_local_rank("dp")
    worst = {"loss": 0.0, "grad": 0.0}
    unmoved: set[str] = set()
    checked = []
    reductions = []
    for step in range(steps):
        batches = [family_batch(family, seed=100 * step + r) for r in range(2)]
        for o in opts:
            o.zero_grad(set_to_none=True)
        ref_loss = sum(ref(input_ids=b, labels=b, use_cache=False).loss for b in batches) / 2
        ref_loss.backward()
        loss = par(input_ids=batches[dp], labels=batches[dp], use_cache=False).loss
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())
        worst["loss"] = nan_safe_max(
            [worst["loss"], allclose_excess(mean / 2, ref_loss.detach(), rtol=RTOL)]
        )
        try:
            grads = gather_full_grads(inner, ref, mesh)
        except GradientCheckError as e:  # e.g. replicated gradients that differ across tp ranks
            return {**worst, "grad": float("inf"), "problems": str(e)}
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        worst["grad"] = nan_safe_max([worst["grad"], grads_excess(grads, ref_grads, rtol=RTOL)])
        # (FSDP2 may leave a rank an empty shard of a small parameter: nothing to move there)
        before = {n: t for n, t in snapshot_params(inner, only_with_grad=True).items() if t.numel()}
        for o in opts:
            o.step()
        unmoved.update(unmoved_params(before, inner))  # not moved, or moved to NaN/inf
        checked.append(len(before))
        reducer = inner._hp_applied.grad_reducer
        reductions.append(reducer.reductions if reducer else 0)
    return {
        **worst,
        "unmoved": sorted(unmoved),
        "min_checked": min(checked),
        "reductions": reductions,
        "n_grads": len(grads),
    }


def ddp_over_validate() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    m = build_family("llama")
    apply(m, plan(m, mesh), mesh, mode="validate")
    try:
        _wrap(m, "ddp", mesh)
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": ""}
