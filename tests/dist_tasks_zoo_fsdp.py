"""Rank-side tasks: zoo models (tests/zoo) under hp on tp, FSDP2 on dp (world 4: dp=2 x tp=2).

The recipe is docs/training.md's, as a user runs it: plan on the training call, ``apply``,
``fully_shard`` every repeated block on ``mesh["dp"]`` and then the root, AdamW built after
wrapping, ``loss.backward()``, ``hp_core.clip_grad_norm_``, ``optimizer.step()``. Each dp
replica trains on its own batch; the single-device reference trains on both (the mean of
their losses) and clips with torch's ``clip_grad_norm_``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from hp_core import applied, apply, clip_grad_norm_, plan
from hp_core.testing.compare import (
    GradientCheckError,
    allclose_excess,
    gather_full_grads,
    grads_excess,
    nan_safe_max,
    snapshot_params,
    unmoved_params,
)
from hp_core.testing.fused import restore_fused
from tests.zoo.survey import BY_NAME, Entry

RTOL = 1e-5
TP = 2
MAX_NORM = 1.0
COMBOS = [(mode, sp) for mode in ("production", "validate") for sp in (True, False)]


def repeated_blocks(model: nn.Module) -> Iterator[nn.Module]:
    """The entries of every ``ModuleList``/``ModuleDict`` holding two or more modules of one
    class (a model's stack of transformer blocks, whatever the container is called)."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList | nn.ModuleDict):
            children = list(module.children())
            if len(children) > 1 and len({type(c) for c in children}) == 1:
                yield from children


def wrap_fsdp(model: nn.Module, mesh: DeviceMesh) -> list[str]:
    """FSDP2 on the dp axis: each repeated block, then the root. Returns the blocks' names."""
    names = {id(m): n for n, m in model.named_modules()}
    blocks = list(repeated_blocks(model))
    for block in blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return [names[id(b)] for b in blocks]


def _logits(out: Any) -> torch.Tensor | None:
    """The logits of a training call's output: a tensor, a tuple's first, or ``.logits``."""
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        out = out[0]
    got = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    return got if isinstance(got, torch.Tensor) else None


def _whole_logits(t: torch.Tensor, ref: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This replica's logits, whole over tp, inferred from the shapes (not from hp's plan)."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    diff = [d for d in range(t.dim()) if t.dim() == ref.dim() and t.shape[d] != ref.shape[d]]
    if len(diff) != 1:
        return t  # equal shapes (replicated), or a mismatch the comparison reports as inf
    group = mesh["tp"].get_group()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=diff[0])


def _full_params(model: nn.Module, ref: nn.Module, mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """Every parameter, whole: gathered (and replica-checked) like a gradient."""
    saved = {n: p.grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = p.detach().clone()
    try:
        ref_shapes = {n: tuple(p.shape) for n, p in ref.named_parameters()}
        return gather_full_grads(model, ref_shapes, mesh)
    finally:
        for n, p in model.named_parameters():
            p.grad = saved[n]


def _off(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str) -> dict[str, float]:
    """``what:name -> excess`` of each tensor beyond the tolerance (for the failure message)."""
    out = {}
    for n in sorted(set(got) | set(ref)):
        e = allclose_excess(got[n], ref[n], rtol=RTOL) if n in got and n in ref else float("inf")
        if not e <= RTOL:
            out[f"{what}:{n}"] = e
    return out


def _train_one(
    entry: Entry,
    mesh: DeviceMesh,
    mode: str,
    sp: bool,
    steps: int = 3,
    hp_reduces: bool = True,
    dp_average: bool = True,
) -> dict[str, Any]:
    """``hp_reduces=False`` drops hp's derived reductions, ``dp_average=False`` makes FSDP2
    sum the replicas' gradients instead of averaging them (the negative controls)."""
    t0 = time.monotonic()
    base = entry.factory()
    ref, par = copy.deepcopy(base), copy.deepcopy(base)
    p = plan(par, mesh, sequence_parallel=sp, example_inputs=entry.batch(0))
    t1 = time.monotonic()
    apply(par, p, mesh, mode=mode)
    t2 = time.monotonic()
    state = applied(par)
    reducer = state.grad_reducer if state is not None else None
    if not hp_reduces and reducer is not None:
        reducer.buckets = []  # the negative control: hp's derived sums never run
    inner = par
    blocks = wrap_fsdp(par, mesh)
    if not dp_average:
        for m in par.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # a sum (gloo has no pre-multiplied sum)
                m.set_force_sum_reduction_for_comms(True)
    # lr 1e-3 moves every weight far beyond the tolerance in 3 steps; eps 1e-5 keeps Adam's
    # update of a rounding-noise gradient below it (docs/testing.md)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-5, foreach=False) for m in (ref, par)]
    dp = mesh.get_local_rank("dp")
    worst = {"loss": 0.0, "logits": 0.0, "grad": 0.0, "norm": 0.0, "param": 0.0}
    unmoved: set[str] = set()
    checked, reductions, logits_seen, norms = [], [], [], []
    n_grads = 0
    off: dict[str, float] = {}
    for step in range(steps):
        batches = [entry.batch(100 * step + r) for r in range(2)]
        for o in opts:
            o.zero_grad(set_to_none=True)
        ref_outs = [ref(**b) for b in batches]
        ref_logits = [_logits(o) for o in ref_outs]
        ref_loss = sum(entry.loss_fn(o, b) for o, b in zip(ref_outs, batches, strict=True)) / 2
        ref_loss.backward()
        out = par(**batches[dp])
        logits = _logits(out)
        mine = ref_logits[dp]
        logits_seen.append(logits is not None and mine is not None)
        if logits is not None and mine is not None:
            whole = _whole_logits(logits.detach(), mine, mesh)
            excess = allclose_excess(whole, mine.detach(), rtol=RTOL)
            worst["logits"] = nan_safe_max([worst["logits"], excess])
        loss = entry.loss_fn(out, batches[dp])
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())
        loss_excess = allclose_excess(mean / 2, ref_loss.detach(), rtol=RTOL)
        worst["loss"] = nan_safe_max([worst["loss"], loss_excess])
        try:
            # a re-arranged fused projection (nanoGPT's c_attn) put back in model order
            grads = restore_fused(gather_full_grads(inner, ref, mesh), p, TP)
        except GradientCheckError as e:  # e.g. replicated gradients that differ across tp ranks
            return {**worst, "grad": float("inf"), "problems": str(e), "blocks": blocks, "off": off}
        ref_grads = {n: q.grad for n, q in ref.named_parameters() if q.grad is not None}
        worst["grad"] = nan_safe_max([worst["grad"], grads_excess(grads, ref_grads, rtol=RTOL)])
        off.update(_off(grads, ref_grads, f"grad@{step}"))
        n_grads = len(grads)
        # the recipe clips: hp's clip on the parallel model, torch's on the single device
        norm = clip_grad_norm_(par, MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        worst["norm"] = nan_safe_max([worst["norm"], allclose_excess(norm, ref_norm, rtol=RTOL)])
        norms.append(float(ref_norm))
        # (FSDP2 may leave a rank an empty shard of a small parameter: nothing to move there)
        before = {n: t for n, t in snapshot_params(inner, only_with_grad=True).items() if t.numel()}
        for o in opts:
            o.step()
        unmoved.update(unmoved_params(before, inner))  # not moved, or moved to NaN/inf
        checked.append(len(before))
        reductions.append(reducer.reductions if reducer else 0)
    try:
        params = restore_fused(_full_params(inner, ref, mesh), p, TP)
    except GradientCheckError as e:  # e.g. a replicated weight that drifted apart across tp
        return {**worst, "param": float("inf"), "problems": str(e), "blocks": blocks, "off": off}
    ref_params = {n: q.detach() for n, q in ref.named_parameters()}
    worst["param"] = grads_excess(params, ref_params, rtol=RTOL)
    off.update(_off(params, ref_params, "param"))
    return {
        **worst,
        "blocks": blocks,
        "unmoved": sorted(unmoved),
        "min_checked": min(checked),
        "reductions": reductions,
        "n_grads": n_grads,
        "n_ref_params": len(ref_params),
        "n_params": len(params),
        "logits_compared": all(logits_seen),
        "off": off,
        "norms": norms,
        "seconds": {"plan": t1 - t0, "apply": t2 - t1, "train": time.monotonic() - t2},
    }


def train(name: str, steps: int = 3) -> dict[str, Any]:
    """Every (mode, sequence_parallel) combination of one zoo entry, plus the negative
    controls (production, SP, one step): hp's derived reductions dropped; FSDP2 summing
    over dp instead of averaging."""
    mesh = init_device_mesh("cpu", (2, TP), mesh_dim_names=("dp", "tp"))
    entry = BY_NAME[name]
    out: dict[str, Any] = {
        f"{mode}:{'sp' if sp else 'no-sp'}": _train_one(entry, mesh, mode, sp, steps, True)
        for mode, sp in COMBOS
    }
    out["no-hp-reductions"] = _train_one(entry, mesh, "production", True, 1, hp_reduces=False)
    out["no-dp-average"] = _train_one(entry, mesh, "production", True, 1, dp_average=False)
    return out
