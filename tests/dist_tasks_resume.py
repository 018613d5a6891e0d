"""Rank-side tasks of the resume tests: model + AdamW state saved with DCP, resumed elsewhere.

A run is 6 AdamW steps on fixed batches. The interrupted runs save after step 3
(``get_model_state_dict`` + ``get_optimizer_state_dict`` + ``dcp.save``), and a fresh model
and optimizer (other seed) on another layout load the checkpoint
(``dcp.load`` + ``set_model_state_dict`` + ``set_optimizer_state_dict``) and run steps 4-6.
Every task returns the worst relative differences against the uninterrupted run.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import hp_core
from hp_core.testing.families import build_family, family_batch

LR = 1e-2
STEPS = 6
SAVE_AT = 3
#: A parameter sharded over tp (dim 0) and the vocab-parallel embedding: their moments.
MOMENT_KEYS = ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight")
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

Batch = dict[str, torch.Tensor]


def _kv4() -> dict[str, Any]:
    return {"num_key_value_heads": 4}  # 4 kv heads: the tiny llama fits tp=2 and tp=4


def _build(family: str, seed: int) -> nn.Module:
    """fp64: AdamW divides by sqrt(exp_avg_sq), which turns fp32's reduction-order noise in
    near-zero gradients into 1e-3 relative parameter differences within 6 steps; in fp64
    sharded and single-device runs agree to ~1e-12, so a resume error cannot hide."""
    cfg = _kv4() if family == "llama" else {}
    return build_family(family, seed=seed, dtype=torch.float64, **cfg)


def _batches(family: str) -> list[Batch]:
    out = []
    for step in range(STEPS):
        ids = family_batch(family, batch=2, seq=16, seed=step)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: list[Batch],
    shard: Callable[[Batch], Batch] = lambda b: b,
) -> list[float]:
    losses = []
    for batch in batches:
        loss = model(**shard(batch), use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The worst ``max|a - b| / max|b|`` over the keys of ``b``."""
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in b)


def _loss_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _moments(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """exp_avg / exp_avg_sq of ``MOMENT_KEYS``, as full tensors."""
    state = get_optimizer_state_dict(model, opt)["state"]
    return {
        f"{k}.{m}": (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k in MOMENT_KEYS
        for m in ("exp_avg", "exp_avg_sq")
        if isinstance(v := state[k][m], torch.Tensor)
    }


def _reference(family: str) -> dict[str, Any]:
    """The uninterrupted single-device run: losses, the moments at step 3, final params."""
    model = _build(family, 0)
    opt = _optimizer(model)
    batches = _batches(family)
    losses = _train(model, opt, batches[:SAVE_AT])
    moments = _moments(model, opt)
    losses += _train(model, opt, batches[SAVE_AT:])
    return {"losses": losses, "moments": moments, "params": _full(model.state_dict())}


def _tp_mesh(tp: int) -> DeviceMesh:
    return init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))


def _applied(family: str, seed: int, mesh: DeviceMesh, mode: str, **plan: Any) -> nn.Module:
    model = _build(family, seed)
    hp_core.apply(model, hp_core.plan(model, mesh, **plan), mesh, mode=mode)
    return model


def _save(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=path)


def _load(path: str, model: nn.Module, opt: torch.optim.Optimizer, **kw: Any) -> None:
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path, **kw)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _resumed(
    path: str,
    model: nn.Module,
    ref: dict[str, Any],
    family: str = "llama",
    shard: Callable[[Batch], Batch] = lambda b: b,
    save_to: str | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """Load ``path`` into ``model`` + a fresh AdamW (saved again to ``save_to`` if given),
    run steps 4-6 and compare with ``ref``."""
    opt = _optimizer(model)
    before = _rel(_moments(model, opt), ref["moments"])  # the fresh state: zeros
    _load(path, model, opt, **kw)
    if save_to is not None:
        _save(save_to, model, opt)
    moments = _rel(_moments(model, opt), ref["moments"])
    losses = _train(model, opt, _batches(family)[SAVE_AT:], shard)
    return {
        "moments_before": before,
        "moments": moments,
        "losses": _loss_rel(losses, ref["losses"][SAVE_AT:]),
        "params": _rel(_full(model.state_dict()), ref["params"]),
    }


def save_tp2(prod: str, val: str) -> dict[str, Any]:
    """Steps 1-3 at tp=2 in production (saved to ``prod``) and in validate (to ``val``); in
    production, scramble the optimizer state and load it back (the negative control)."""
    ref = _reference("llama")
    out: dict[str, Any] = {}
    for mode, path in (("production", prod), ("validate", val)):
        model = _applied("llama", 0, _tp_mesh(2), mode)
        opt = _optimizer(model)
        out[f"{mode}_losses"] = _loss_rel(_train(model, opt, _batches("llama")[:SAVE_AT]), ref["losses"][:SAVE_AT])
        out[f"{mode}_moments"] = _rel(_moments(model, opt), ref["moments"])
        _save(path, model, opt)
    # Production's saved moments are DTensor views; scramble the optimizer, then restore it.
    osd = get_optimizer_state_dict(model, opt)
    out["saved_types"] = {type(osd["state"][k]["exp_avg"]).__name__ for k in MOMENT_KEYS}
    out["step_type"] = type(osd["state"][MOMENT_KEYS[0]]["step"]).__name__
    return out


def resume_at_tp(paths: list[str], tp: int, save_to: str | None) -> dict[str, Any]:
    """Resume each checkpoint in ``paths`` at ``tp`` (production); the first resumed model
    is saved again (at step 3) to ``save_to`` when given, for the next layout."""
    ref = _reference("llama")
    return {
        path: _resumed(
            path,
            _applied("llama", 1, _tp_mesh(tp), "production"),
            ref,
            save_to=save_to if path == paths[0] else None,
        )
        for path in paths
    }


def resume_one_process(path: str) -> dict[str, Any] | None:
    """Rank 0 alone: the checkpoint into a plain, unsharded model and a plain AdamW."""
    out = None
    if dist.get_rank() == 0:
        ref = _reference("llama")
        out = _resumed(path, _build("llama", 1), ref, no_dist=True)
    dist.barrier()
    return out
