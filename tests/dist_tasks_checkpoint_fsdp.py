"""Rank-side tasks of the FSDP2-on-dp checkpoint tests (importable by the spawned ranks).

hp on tp inside, FSDP2 on dp outside (world 4: dp=2 x tp=2). The state dict holds one
DTensor per parameter over dp and tp together, so ``torch.distributed.checkpoint`` saves
every value once and reshards it to tp-only worlds and to one process.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import hp_core
from hp_core.testing.families import build_family, family_batch

Q = "model.layers.0.self_attn.q_proj.weight"  # hp Shard(0) on tp: FSDP's split inside hp's
O_PROJ = "model.layers.0.self_attn.o_proj.weight"  # hp Shard(1) on tp: FSDP's Shard(0) beside it
NORM = "model.norm.weight"  # replicated by hp: an ordinary FSDP DTensor


def _kv4(**extra: Any) -> dict[str, Any]:
    return {"num_key_value_heads": 4, **extra}  # 4 kv heads: fits tp=2 and tp=4


def _full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in state.items()
    }


def _excess(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        return float("inf")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _logits(model: Any) -> torch.Tensor:
    batch = family_batch("llama", batch=2, seq=16)
    with torch.no_grad():
        return model(input_ids=batch, use_cache=False).logits.detach().clone()


def _spec(value: Any) -> tuple[tuple[str, ...], str]:
    return tuple(value.device_mesh.mesh_dim_names or ()), str(tuple(value.placements))


def _fsdp(model: Any, mode: str, sp: bool) -> Any:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    hp_core.apply(model, hp_core.plan(model, mesh, sequence_parallel=sp), mesh, mode=mode)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _train_two_steps(par: Any, ref: Any, dp: int) -> None:
    """Two AdamW steps; each dp replica on its own batch, the reference on both at once."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (ref, par)]
    for step in range(2):
        batches = [family_batch("llama", seed=100 * step + r) for r in range(2)]
        ref_loss = sum(ref(input_ids=b, labels=b, use_cache=False).loss for b in batches) / 2
        ref_loss.backward()
        par(input_ids=batches[dp], labels=batches[dp], use_cache=False).loss.backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)


def fsdp_round_trip(path: str, mode: str, sp: bool) -> dict[str, Any]:
    """Train 2 steps at dp=2 x tp=2 under FSDP2, dcp.save, scramble, dcp.load back.

    Rank 0 also writes the gathered parameters and the trained single-device reference's
    logits next to the checkpoint, for the resharding tests to compare with.
    """
    base = build_family("llama", seed=0, **_kv4())
    ref = copy.deepcopy(base)
    par = _fsdp(copy.deepcopy(base), mode, sp)
    dp = dist.get_rank() // 2
    _train_two_steps(par, ref, dp)
    saved = get_model_state_dict(par)
    specs = {k: _spec(saved[k]) for k in (Q, O_PROJ, NORM)}
    full_saved = _full(saved)
    trained = _excess(full_saved, {k: v.detach() for k, v in ref.state_dict().items()})
    logits = _logits(par)
    dcp.save(saved, checkpoint_id=path)
    with torch.no_grad():  # scramble every parameter in place (FSDP's own shards)
        for p in par.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.add_(torch.randn_like(local))
    scrambled = _excess(_full(get_model_state_dict(par)), full_saved)
    target = get_model_state_dict(par)
    dcp.load(target, checkpoint_id=path)
    set_model_state_dict(par, target)
    restored = _excess(_full(get_model_state_dict(par)), full_saved)
    logits_after = _logits(par)
    if dist.get_rank() == 0:
        torch.save({"params": full_saved, "logits": _logits(ref)}, f"{path}.reference.pt")
    dist.barrier()
    return {
        "specs": specs,
        "trained": trained,
        "logits_vs_ref": float((logits - _logits(ref)).abs().max()),
        "scrambled": scrambled,
        "restored": restored,
        "logits": float((logits_after - logits).abs().max()),
    }


def _compare(model: Any, reference: dict[str, Any]) -> dict[str, Any]:
    got = _full(get_model_state_dict(model))
    return {
        "params": _excess(got, reference["params"]),
        "logits": float((_logits(model) - reference["logits"]).abs().max()),
    }


def load_at_tp(path: str, tp: int) -> dict[str, Any]:
    """Load the dp x tp FSDP2 checkpoint at tp (this world's size, no FSDP)."""
    reference = torch.load(f"{path}.reference.pt")
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    model = build_family("llama", seed=1, **_kv4())
    hp_core.apply(model, hp_core.plan(model, mesh), mesh)
    before = _compare(model, reference)["params"]
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    return {"before": before, **_compare(model, reference)}


def save_at_tp4(path: str) -> bool:
    """Save the seed-0 model at tp=4 (world 4, no FSDP)."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    model = build_family("llama", seed=0, **_kv4())
    hp_core.apply(model, hp_core.plan(model, mesh), mesh)
    dcp.save(model.state_dict(), checkpoint_id=path)
    return True


def load_into_fsdp(path: str, mode: str) -> dict[str, Any]:
    """Load a tp=4 checkpoint of the seed-0 model into dp=2 x tp=2 under FSDP2."""
    one = build_family("llama", seed=0, **_kv4())
    reference = {"params": {k: v.detach() for k, v in one.state_dict().items()}}
    reference["logits"] = _logits(one)
    model = _fsdp(build_family("llama", seed=1, **_kv4()), mode, sp=True)
    before = _compare(model, reference)["params"]
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)
    return {"before": before, **_compare(model, reference)}


def load_a_wider_checkpoint(path: str) -> dict[str, Any]:
    """A checkpoint of a model with a wider MLP cannot load into this one; nothing changes."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    wide = build_family("llama", seed=0, **_kv4(intermediate_size=256))
    hp_core.apply(wide, hp_core.plan(wide, mesh), mesh)
    dcp.save(wide.state_dict(), checkpoint_id=path)
    model = _fsdp(build_family("llama", seed=1, **_kv4()), "production", sp=False)
    before = _full(get_model_state_dict(model))
    state = get_model_state_dict(model)
    try:
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state)
        error = None
    except CheckpointException as e:  # DCP gathers every rank's error (a BaseException)
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "unchanged": _excess(_full(get_model_state_dict(model)), before)}
