"""Rank-side tasks: resumes into a context-parallel layout, and expert-parallel model and
optimizer state moved to one process and back.

The tp=2 checkpoint of ``dist_tasks_resume`` resumes at cp=2 x tp=2 (the cp loss and batch
helpers of hp-plugin-cp). An ep=2 qwen2_moe checkpoint of model + AdamW loads into one
plain process and that process's checkpoint loads back into ep=2: every parameter and
every moment equal the saved model's (fp32: transformers' grouped_mm refuses fp64, and no
step is compared, only the values moved).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import hp_core
from hp_core.testing.families import build_family, family_batch
from hp_plugin_cp import enable_cp_loss, shard_batch_for_cp
from tests.dist_tasks_resume import (
    CP_YAML,
    EP_YAML,
    _applied,
    _full,
    _load,
    _optimizer,
    _reference,
    _rel,
    _resumed,
)


def resume_at_cp_tp(path: str) -> dict[str, Any]:
    """The tp=2 checkpoint resumed at cp=2 x tp=2: steps 4-6 match one device."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    model = _applied("llama", 1, mesh, "production", overrides=CP_YAML)
    enable_cp_loss(model, mesh["cp"])
    return _resumed(
        path, model, _reference("llama"), shard=lambda b: shard_batch_for_cp(b, mesh["cp"])
    )


def _moe(seed: int) -> nn.Module:
    return build_family("qwen2_moe", seed=seed)


def _every_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and every AdamW moment of ``model``, as full tensors."""
    out = {f"param {k}": v for k, v in _full(model.state_dict()).items()}
    for key, entry in get_optimizer_state_dict(model, opt)["state"].items():
        for m in ("exp_avg", "exp_avg_sq"):
            value = entry[m]
            full = value.full_tensor() if isinstance(value, DTensor) else value
            out[f"{key}.{m}"] = full.detach().clone()
    return out


def _trained_ep(seed: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = _moe(seed)
    hp_core.apply(model, hp_core.plan(model, mesh, ep_size=2, overrides=EP_YAML), mesh)
    opt = _optimizer(model)
    for step in range(steps):
        ids = family_batch("qwen2_moe", batch=2, seq=16, seed=step)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def expert_state_to_one_process_and_back(path: str) -> dict[str, Any]:
    """ep=2 model + AdamW (2 steps) saved; loaded into one plain process (rank 0), whose own
    checkpoint loads back into a fresh ep=2 model and optimizer."""
    model, opt = _trained_ep(0, 2)
    saved = _every_state(model, opt)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=path)
    out: dict[str, Any] = {"single": None, "single_before": None}
    if dist.get_rank() == 0:
        whole = _moe(1)
        whole_opt = _optimizer(whole)
        out["single_before"] = _rel(_every_state(whole, whole_opt), saved)
        _load(path, whole, whole_opt, no_dist=True)
        out["single"] = _rel(_every_state(whole, whole_opt), saved)
        state = {
            "model": get_model_state_dict(whole),
            "optim": get_optimizer_state_dict(whole, whole_opt),
        }
        dcp.save(state, checkpoint_id=path + "-whole", no_dist=True)  # rank 0 alone
    dist.barrier()
    fresh, fresh_opt = _trained_ep(2, 1)
    out["back_before"] = _rel(_every_state(fresh, fresh_opt), saved)
    _load(path + "-whole", fresh, fresh_opt)
    out["back"] = _rel(_every_state(fresh, fresh_opt), saved)
    return out


__all__ = ["expert_state_to_one_process_and_back", "resume_at_cp_tp"]
