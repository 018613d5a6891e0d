"""Rank-side tasks of the gradient-clipping tests (importable by the spawned ranks).

Every task builds a single-device reference and a parallel copy of one seeded tiny
model, runs one forward/backward per norm type on the same data, then clips the
reference with ``torch.nn.utils.clip_grad_norm_`` and the copy with
``hp_core.clip_grad_norm_`` (``max_norm`` a quarter of the reference's norm, so both
clip) and reports, per norm type: both norms, their relative difference, the gradient
excess before clipping (is the composition itself right?) and after clipping, and the
naive norm (local norms summed over the group without counting copies once).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import hp_core
from hp_core.runtime import clip
from hp_core.testing.compare import gather_full_grads, grads_excess
from hp_core.testing.families import build_family, family_batch

RTOL = 1e-5
NORM_TYPES = (2.0, 1.0, math.inf)

CP_YAML = """
- match: "*.self_attn"
  when: cp
  inner_target: self
  inner_wrapper: sdpa_hf
  region_dispatch: false
"""

EP_YAML = """
overrides:
  - match: "model.layers.*.mlp"
    when: ep
    local_compute_fn: qwen2moe
    region_dispatch: false
"""


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _batch(family: str, rows: int) -> dict[str, torch.Tensor]:
    ids = family_batch(family, batch=rows, seq=16, seed=7)
    return {"input_ids": ids, "labels": ids.clone()}


def _ref_grads(ref: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if isinstance(g, DTensor) else g


def _naive_norm(par: nn.Module, group: Any) -> float:
    """The usual mistake: every rank's local norm², summed over ``group``, square root."""
    grads = [_local(p.grad) for p in par.parameters() if p.grad is not None]
    local = sum(float(g.double().pow(2).sum()) for g in grads)
    t = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return math.sqrt(float(t))


def _run(
    ref: nn.Module,
    par: nn.Module,
    ref_batch: dict[str, torch.Tensor],
    par_forward: Callable[[], torch.Tensor],
    gather: Callable[[], dict[str, torch.Tensor]],
    *,
    clip_target: nn.Module | None = None,
    naive_group: Any = None,
    norm_types: tuple[float, ...] = NORM_TYPES,
) -> dict[str, Any]:
    """One forward/backward and one clip per norm type; the measurements, by norm type."""
    out: dict[str, Any] = {}
    for p in norm_types:
        ref.zero_grad(set_to_none=True)
        par.zero_grad(set_to_none=True)
        ref(**ref_batch, use_cache=False).loss.backward()
        par_forward().backward()
        expected = _ref_grads(ref)
        pre = grads_excess(gather(), expected, rtol=RTOL)
        ref_norm = float(torch.nn.utils.get_total_norm([g for g in expected.values()], p))
        max_norm = 0.25 * ref_norm
        naive = _naive_norm(par, naive_group) if p == 2.0 and naive_group is not None else None
        got_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, p)
        got = hp_core.clip_grad_norm_(clip_target if clip_target is not None else par, max_norm, p)
        norms = [torch.zeros(()) for _ in range(dist.get_world_size())]
        dist.all_gather_object(norms, got.detach().clone())
        post = grads_excess(gather(), _ref_grads(ref), rtol=RTOL)
        out[str(p)] = {
            "ref": float(got_ref),
            "par": float(got),
            "rel": abs(float(got) - float(got_ref)) / float(got_ref),
            "same_on_ranks": all(bool(torch.equal(n, norms[0])) for n in norms),
            "zero_dim": got.dim() == 0,
            "pre": pre,
            "post": post,
            "naive_rel": None if naive is None else abs(naive - float(got_ref)) / float(got_ref),
        }
    grads = [q.grad for q in par.parameters() if q.grad is not None]
    out["n_grads"] = len(grads)
    out["n_dtensor_grads"] = sum(isinstance(g, DTensor) for g in grads)
    # How many ranks hold each layout's chunk (what the clip counted), for the report.
    out["replicas"] = sorted({r for rs in clip._REPLICAS.get(par, {}).values() for r in rs})
    return out


def tp(mode: str, sp: bool, **config: Any) -> dict[str, Any]:
    """tp=2, sequence parallelism on or off, one mode (``config``: the llama's overrides)."""
    mesh = _mesh((2,), ("tp",))
    base = build_family("llama", seed=0, **config)
    ref, par = copy.deepcopy(base), copy.deepcopy(base)
    hp_core.apply(par, hp_core.plan(par, mesh, sequence_parallel=sp), mesh, mode=mode)
    batch = _batch("llama", 2)
    return _run(
        ref,
        par,
        batch,
        lambda: par(**batch, use_cache=False).loss,
        lambda: gather_full_grads(par, ref, mesh),
        naive_group=mesh.get_group("tp"),
    )


def _gather_fsdp_tp(par: nn.Module, ref: nn.Module, mesh: Any) -> dict[str, torch.Tensor]:
    """Whole gradients of an FSDP2-over-dp, hp-over-tp model, from shapes only (no plan).

    FSDP2's DTensor gradient gives the tp-local gradient with ``full_tensor()``; a dim
    that is then smaller than the reference's is a tp shard, all-gathered over tp.
    """
    shapes = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    group = mesh.get_group("tp")
    out: dict[str, torch.Tensor] = {}
    for n, p in par.named_parameters():
        if p.grad is None:
            continue
        local = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.detach()
        dims = [d for d, (a, b) in enumerate(zip(local.shape, shapes[n], strict=True)) if a != b]
        if dims:
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, local.contiguous(), group=group)
            local = torch.cat(parts, dim=dims[0])
        out[n] = local
    return out


def dp_tp(wrap: str, mode: str = "production") -> dict[str, Any]:
    """dp=2 x tp=2, with DDP over dp or FSDP2 ``fully_shard`` over dp."""
    mesh = _mesh((2, 2), ("dp", "tp"))
    base = build_family("llama", seed=0)
    ref, par = copy.deepcopy(base), copy.deepcopy(base)
    hp_core.apply(par, hp_core.plan(par, mesh), mesh, mode=mode)
    full = _batch("llama", 4)
    row = mesh.get_local_rank("dp") * 2
    mine = {k: v[row : row + 2] for k, v in full.items()}
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped: nn.Module = DistributedDataParallel(par, process_group=mesh["dp"].get_group())
        return _run(
            ref,
            par,
            full,
            lambda: wrapped(**mine, use_cache=False).loss,
            lambda: gather_full_grads(par, ref, mesh),
            clip_target=wrapped,
            naive_group=dist.group.WORLD,
        )
    from torch.distributed.fsdp import fully_shard

    for layer in par.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(par, mesh=mesh["dp"])
    return _run(
        ref,
        par,
        full,
        lambda: par(**mine, use_cache=False).loss,
        lambda: _gather_fsdp_tp(par, ref, mesh),
    )


def ep() -> dict[str, Any]:
    """Qwen2-MoE on tp=2 (sequence parallel) with expert parallelism ep=2, both modes."""
    mesh = _mesh((2,), ("tp",))
    base = build_family("qwen2_moe", seed=0)
    batch = _batch("qwen2_moe", 2)
    out: dict[str, Any] = {}
    for mode in ("production", "validate"):
        ref, par = copy.deepcopy(base), copy.deepcopy(base)
        hp_core.apply(par, hp_core.plan(par, mesh, ep_size=2, overrides=EP_YAML), mesh, mode=mode)
        experts = par._hp_applied.expert_meshes

        def gather(par: nn.Module = par, ref: nn.Module = ref, experts: Any = experts) -> Any:
            return gather_full_grads(par, ref, mesh, expert_groups=experts)

        out[mode] = _run(
            ref,
            par,
            batch,
            lambda par=par: par(**batch, use_cache=False).loss,
            gather,
            naive_group=mesh.get_group("tp"),
            norm_types=(2.0, math.inf),
        )
    return out


def cp() -> dict[str, Any]:
    """cp=2 with the CP override of docs/cp.md, production."""
    from hp_plugin_cp import enable_cp_loss, shard_batch_for_cp

    mesh = _mesh((2,), ("cp",))
    base = build_family("llama", seed=0)
    ref, par = copy.deepcopy(base), copy.deepcopy(base)
    hp_core.apply(par, hp_core.plan(par, mesh, overrides=CP_YAML), mesh, mode="production")
    enable_cp_loss(par, mesh["cp"])
    batch = _batch("llama", 2)
    sharded = shard_batch_for_cp(batch, mesh["cp"])
    return _run(
        ref,
        par,
        batch,
        lambda: par(**sharded, use_cache=False).loss,
        lambda: gather_full_grads(par, ref, mesh),
        naive_group=mesh.get_group("cp"),
        norm_types=(2.0, 1.0),
    )


def nonfinite() -> dict[str, Any]:
    """One rank's gradient holds an inf: ``error_if_nonfinite`` raises on every rank, before
    scaling; without it the norm is inf everywhere and the gradients are scaled by it."""
    mesh = _mesh((2,), ("tp",))
    par = build_family("llama", seed=0)
    hp_core.apply(par, hp_core.plan(par, mesh), mesh, mode="production")
    batch = _batch("llama", 2)
    par(**batch, use_cache=False).loss.backward()
    grad = par.get_parameter("model.layers.0.self_attn.q_proj.weight").grad
    if dist.get_rank() == 0:
        grad[0, 0] = math.inf
    before = grad.clone()
    out: dict[str, Any] = {}
    try:
        hp_core.clip_grad_norm_(par, 1.0, error_if_nonfinite=True)
        out["raised"] = None
    except RuntimeError as e:
        out["raised"] = type(e).__name__
        out["is_hp_error"] = isinstance(e, hp_core.HpError)
        out["message"] = str(e)
    out["untouched"] = bool(torch.equal(grad, before))
    total = hp_core.clip_grad_norm_(par, 1.0)
    out["total"] = float(total)
    return out
