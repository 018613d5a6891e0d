"""Rank-side tasks of the checkpoint-layout tests (importable by the spawned ranks).

A production model's state dict exposes each sharded parameter as a DTensor view over its
local shard, so ``torch.distributed.checkpoint`` saves and restores it for what it is.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import hp_core
from hp_core.testing.families import build_family, family_batch


def _excess(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in state.items()
    }


def dcp_round_trip(path: str, mode: str) -> dict[str, Any]:
    """Save a tp=2 model with DCP, scramble it, load it back; then load the checkpoint into
    a whole single-process copy (resharding tp=2 → one process)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    base = build_family("llama", seed=0)
    reference = {k: v.detach().clone() for k, v in base.state_dict().items()}
    model = copy.deepcopy(base)
    hp_core.apply(model, hp_core.plan(model, mesh), mesh, mode=mode)
    batch = family_batch("llama", batch=2, seq=16)
    with torch.no_grad():
        logits = model(input_ids=batch, use_cache=False).logits.clone()
    state = model.state_dict()
    kinds = {k: isinstance(v, DTensor) for k, v in state.items()}
    full_before = _full(state)
    dcp.save(state, checkpoint_id=path)
    with torch.no_grad():  # scramble every parameter in place
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.add_(torch.randn_like(local))
    scrambled = _excess(_full(model.state_dict()), reference)
    target = get_model_state_dict(model)
    dcp.load(target, checkpoint_id=path)
    set_model_state_dict(model, target)
    restored = _excess(_full(model.state_dict()), reference)
    with torch.no_grad():
        logits_after = model(input_ids=batch, use_cache=False).logits
    dist.barrier()
    single = None
    if dist.get_rank() == 0:  # one process, no process group: the whole model
        whole = build_family("llama", seed=1)  # different weights until loaded
        whole_state = whole.state_dict()
        dcp.load(whole_state, checkpoint_id=path, no_dist=True)
        whole.load_state_dict(whole_state)
        single = _excess({k: v.detach() for k, v in whole.state_dict().items()}, reference)
    dist.barrier()
    return {
        "sharded_keys": sorted(k for k, d in kinds.items() if d),
        "plain_keys": sorted(k for k, d in kinds.items() if not d),
        "saved_excess": _excess(full_before, reference),
        "scrambled": scrambled,
        "restored": restored,
        "logits": float((logits_after - logits).abs().max()),
        "single": single,
    }


def load_full_and_refuse_a_shard() -> dict[str, Any]:
    """``load_state_dict`` of full tensors keeps each rank's slice; a local shard is refused."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    base = build_family("llama", seed=0)
    full = {k: v.detach().clone() for k, v in base.state_dict().items()}
    model = build_family("llama", seed=1)
    hp_core.apply(model, hp_core.plan(model, mesh), mesh)
    model.load_state_dict(full)
    loaded = _excess(_full(model.state_dict()), full)
    key = "model.layers.0.self_attn.q_proj.weight"
    shard = model.state_dict()[key].to_local().clone()
    before = _full(model.state_dict())
    try:
        model.load_state_dict({**full, key: shard})
        error = None
    except hp_core.HpError as e:
        error = f"{type(e).__name__}: {e}"
    unchanged = _excess(_full(model.state_dict()), before)
    return {"loaded": loaded, "error": error, "unchanged": unchanged}


EP_YAML = """
overrides:
  - match: "model.layers.*.mlp"
    when: ep
    local_compute_fn: qwen2moe
    region_dispatch: false
"""


def other_values() -> dict[str, Any]:
    """A replicated DTensor is redistributed into the shard; a non-tensor is torch's error."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    full = {k: v.detach().clone() for k, v in build_family("llama", seed=0).state_dict().items()}
    model = build_family("llama", seed=1)
    hp_core.apply(model, hp_core.plan(model, mesh), mesh)
    key = "model.layers.0.mlp.up_proj.weight"
    replicated = distribute_tensor(full[key], mesh, [Replicate()])
    model.load_state_dict({**full, key: replicated})
    redistributed = _excess(_full(model.state_dict()), full)
    try:
        model.load_state_dict({**full, key: "not a tensor"})
        non_tensor = None
    except RuntimeError as e:
        non_tensor = str(e)
    return {"redistributed": redistributed, "non_tensor": non_tensor}


def expert_round_trip(path: str) -> dict[str, Any]:
    """A production model with stacked expert-parallel parameters: each carries its layout on
    the expert mesh, so dcp.save / scramble / dcp.load restores every value and the logits."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    moe = build_family("qwen2_moe", seed=0)
    hp_core.apply(moe, hp_core.plan(moe, mesh, ep_size=2, overrides=EP_YAML), mesh)
    batch = family_batch("qwen2_moe", batch=2, seq=16)
    with torch.no_grad():
        logits = moe(input_ids=batch, use_cache=False).logits.clone()
    state = moe.state_dict()
    experts = sorted(k for k in state if ".experts." in k and isinstance(state[k], DTensor))
    meshes = {tuple(state[k].device_mesh.mesh_dim_names or ()) for k in experts}
    before = _full(state)
    dcp.save(state, checkpoint_id=path)
    with torch.no_grad():
        for p in moe.parameters():
            p.add_(torch.randn_like(p))
    scrambled = _excess(_full(moe.state_dict()), before)
    target = get_model_state_dict(moe)
    dcp.load(target, checkpoint_id=path)
    set_model_state_dict(moe, target)
    restored = _excess(_full(moe.state_dict()), before)
    with torch.no_grad():
        logits_after = moe(input_ids=batch, use_cache=False).logits
    return {
        "experts": experts,
        "meshes": meshes,
        "scrambled": scrambled,
        "restored": restored,
        "logits": float((logits_after - logits).abs().max()),
        **_experts_across_layouts(path, before, logits, batch),
    }


def _experts_across_layouts(
    path: str, saved: dict[str, torch.Tensor], logits: torch.Tensor, batch: torch.Tensor
) -> dict[str, Any]:
    """The ep=2 checkpoint loads into one whole model in one process (rank 0); that model's
    own checkpoint, saved in one process, loads back into a fresh ep=2 model."""
    whole_path = path + "-whole"
    out: dict[str, Any] = {"single": None, "single_logits": None}
    if dist.get_rank() == 0:
        whole = build_family("qwen2_moe", seed=1)
        state = whole.state_dict()
        dcp.load(state, checkpoint_id=path, no_dist=True)
        whole.load_state_dict(state)
        out["single"] = _excess({k: v.detach() for k, v in whole.state_dict().items()}, saved)
        with torch.no_grad():
            single_logits = whole(input_ids=batch, use_cache=False).logits
        out["single_logits"] = float((single_logits - logits).abs().max())
        dcp.save(whole.state_dict(), checkpoint_id=whole_path, no_dist=True)
    dist.barrier()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    fresh = build_family("qwen2_moe", seed=2)
    hp_core.apply(fresh, hp_core.plan(fresh, mesh, ep_size=2, overrides=EP_YAML), mesh)
    out["fresh_before"] = _excess(_full(fresh.state_dict()), saved)
    target = get_model_state_dict(fresh)
    dcp.load(target, checkpoint_id=whole_path)
    set_model_state_dict(fresh, target)
    out["back"] = _excess(_full(fresh.state_dict()), saved)
    return out


def _kv4() -> dict[str, Any]:
    return {"num_key_value_heads": 4}  # 4 kv heads: the tiny llama fits tp=2 and tp=4


def save_at(path: str, tp: int) -> bool:
    """Save the seed-0 model applied at ``tp`` (this world's size) with DCP."""
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    model = build_family("llama", seed=0, **_kv4())
    hp_core.apply(model, hp_core.plan(model, mesh), mesh)
    dcp.save(model.state_dict(), checkpoint_id=path)
    return True


def load_at(path: str, tp: int) -> dict[str, Any]:
    """Load a checkpoint saved at another tp into a model applied at ``tp``; compare every
    parameter and the logits with the seed-0 single-device model."""
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    reference = build_family("llama", seed=0, **_kv4())
    model = build_family("llama", seed=1, **_kv4())
    hp_core.apply(model, hp_core.plan(model, mesh), mesh)
    before = _excess(_full(model.state_dict()), reference.state_dict())
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    batch = family_batch("llama", batch=2, seq=16)
    with torch.no_grad():
        logits = float(
            (
                model(input_ids=batch, use_cache=False).logits
                - reference(input_ids=batch, use_cache=False).logits
            )
            .abs()
            .max()
        )
    after = _excess(_full(model.state_dict()), reference.state_dict())
    return {"before": before, "after": after, "logits": logits}
