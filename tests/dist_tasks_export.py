"""Rank-side tasks of the full-export tests (importable by the spawned ranks).

``hp_core.full_state_dict`` gathers an hp model's full state dict under its names from
before ``apply``; these tasks compare it with the single-device model's state dict, save
it with ``save_pretrained`` and load it back with ``from_pretrained``.
"""

from __future__ import annotations

import copy
import gc
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import hp_core
from hp_core.checkpoint.names import original_names
from hp_core.testing.families import build_family, family_batch

TOL = 1e-6


def state_dict_problems(
    got: Mapping[str, Any], want: Mapping[str, torch.Tensor], tol: float = TOL
) -> list[str]:
    """Every difference between two full state dicts: keys, shapes, dtypes, values > tol."""
    problems = [f"missing {k}" for k in sorted(set(want) - set(got))]
    problems += [f"unexpected {k}" for k in sorted(set(got) - set(want))]
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        if not isinstance(a, torch.Tensor) or isinstance(a, DTensor):
            problems.append(f"{k}: a {type(a).__name__}, not a plain tensor")
        elif a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{k}: {tuple(a.shape)} {a.dtype} != {tuple(b.shape)} {b.dtype}")
        elif a.numel() and float((a - b).abs().max()) > tol:
            problems.append(f"{k}: values differ by {float((a - b).abs().max()):.3g}")
    return problems


def _reference(family: str, **kw: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    base = build_family(family, seed=0, **kw)
    return base, {k: v.detach().clone() for k, v in base.state_dict().items()}


def _logits(model: Any, family: str) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=family_batch(family, batch=2, seq=16), use_cache=False).logits


def tp_export(family: str, mode: str, path: str, tied: bool = False) -> dict[str, Any]:
    """Export at tp=2; rank 0 saves it with save_pretrained and loads it with from_pretrained."""
    from transformers import AutoModelForCausalLM

    kw = {"tie_word_embeddings": True} if tied else {}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    base, want = _reference(family, **kw)
    single = _logits(base, family)
    model = copy.deepcopy(base)
    hp_core.apply(model, hp_core.plan(model, mesh), mesh, mode=mode)
    sharded = _logits(model, family)
    on_rank0 = hp_core.full_state_dict(model)
    everywhere = hp_core.full_state_dict(model, rank0_only=False)
    out: dict[str, Any] = {
        "rank0_only_empty": on_rank0 == {},
        "rank0_only": state_dict_problems(on_rank0, want) if on_rank0 else None,
        "everywhere": state_dict_problems(everywhere, want),
        "tied_one_tensor": (
            everywhere["lm_head.weight"] is everywhere["model.embed_tokens.weight"]
            if tied
            else None
        ),
        "sharded_vs_single": float((sharded - single).abs().max()),
    }
    if dist.get_rank() == 0:
        model.save_pretrained(path, state_dict=on_rank0)
        loaded = AutoModelForCausalLM.from_pretrained(path)
        out["loaded_params"] = state_dict_problems(
            {k: v.detach() for k, v in loaded.state_dict().items()}, want
        )
        out["loaded_vs_single"] = float((_logits(loaded, family) - single).abs().max())
        out["loaded_vs_sharded"] = float((_logits(loaded, family) - sharded).abs().max())
    dist.barrier()
    return out


def corrupted_shard(mode: str) -> dict[str, Any]:
    """Negative control: one wrong value in one rank's shard shows up in the export."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    base, want = _reference("llama")
    model = copy.deepcopy(base)
    hp_core.apply(model, hp_core.plan(model, mesh), mesh, mode=mode)
    key = "model.layers.1.mlp.down_proj.weight"
    before = state_dict_problems(hp_core.full_state_dict(model, rank0_only=False), want)
    if dist.get_rank() == 1:
        with torch.no_grad():
            p = model.get_parameter(key)
            (p.to_local() if isinstance(p, DTensor) else p)[3, 5] += 0.5
    after = state_dict_problems(hp_core.full_state_dict(model, rank0_only=False), want)
    return {"before": before, "after": after}


def _holding(stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """An iterator that keeps the tensor it yielded last (what the check must catch)."""
    previous = None
    for name, tensor in stream:
        previous = tensor
        yield name, tensor
    del previous


def _alive_after_drop(stream: Iterator[tuple[str, torch.Tensor]]) -> tuple[int, dict[str, Any]]:
    """How many yielded tensors were still alive after the consumer dropped them, without
    asking for the next: a consumer that keeps only a copy of each. (A collective's worker
    thread may let go of its buffers a moment after the call returns: 0.1 s of grace.)"""
    alive = 0
    got: dict[str, torch.Tensor] = {}
    for name, tensor in stream:
        got[name] = tensor.clone()
        ref = weakref.ref(tensor)
        del tensor
        deadline = time.monotonic() + 0.1
        while ref() is not None and time.monotonic() < deadline:
            time.sleep(0.001)
        alive += ref() is not None
    return alive, got


def streaming(mode: str) -> dict[str, Any]:
    """``iter_full_state_dict`` keeps no yielded tensor alive: once the consumer drops one,
    it is freed before the next arrives (weak references), on every rank."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    base, want = _reference("llama")
    model = copy.deepcopy(base)
    hp_core.apply(model, hp_core.plan(model, mesh), mesh, mode=mode)
    gc.disable()  # only reference counting may free a tensor: what the iterator holds stays
    try:
        alive, got = _alive_after_drop(hp_core.iter_full_state_dict(model, rank0_only=False))
        held, _ = _alive_after_drop(_holding(hp_core.iter_full_state_dict(model, rank0_only=False)))
        alive0, got0 = _alive_after_drop(hp_core.iter_full_state_dict(model))
    finally:
        gc.enable()
    return {
        "alive_after_drop": alive,
        "holding_alive_after_drop": held,
        "count": len(got),
        "problems": state_dict_problems(got, want),
        "rank0_only_alive_after_drop": alive0,
        "rank0_only_names": len(got0),
        "rank0_only_problems": state_dict_problems(got0, want) if got0 else None,
    }


EP_YAML = """
overrides:
  - match: "model.layers.*.mlp"
    when: ep
    local_compute_fn: qwen2moe
    region_dispatch: false
"""

LIST_YAML = """
overrides:
  - match: "model.layers.*.block_sparse_moe"
    when: ep
    local_compute_fn: routed_only
    region_dispatch: false
"""


def expert_export(mode: str, path: str) -> dict[str, Any]:
    """ep=2: qwen2_moe's batched experts and a per-expert ModuleList toy (stacked at apply,
    unstacked on export) export to the unapplied model's state dict; qwen2_moe's export
    goes through save_pretrained (which converts its experts to the checkpoint format)
    and from_pretrained back to the single-device logits."""
    from transformers import AutoModelForCausalLM

    from tests._toy_models import list_moe_lm

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    base, want = _reference("qwen2_moe")
    single = _logits(base, "qwen2_moe")
    moe = copy.deepcopy(base)
    hp_core.apply(moe, hp_core.plan(moe, mesh, ep_size=2, overrides=EP_YAML), mesh, mode=mode)
    on_rank0 = hp_core.full_state_dict(moe)
    if dist.get_rank() == 0:
        moe.save_pretrained(path, state_dict=on_rank0)
        loaded = AutoModelForCausalLM.from_pretrained(path)
        out["loaded_vs_single"] = float((_logits(loaded, "qwen2_moe") - single).abs().max())
    dist.barrier()
    state = moe.state_dict()
    out["qwen2_moe_expert_meshes"] = sorted(
        {
            tuple(v.device_mesh.mesh_dim_names or ())
            for k, v in state.items()
            if ".experts." in k and isinstance(v, DTensor)
        }
    )
    out["qwen2_moe"] = state_dict_problems(hp_core.full_state_dict(moe, rank0_only=False), want)
    torch.manual_seed(0)
    toy = list_moe_lm()
    toy_want = {k: v.detach().clone() for k, v in toy.state_dict().items()}
    hp_core.apply(toy, hp_core.plan(toy, mesh, ep_size=2, overrides=LIST_YAML), mesh, mode=mode)
    names = original_names(toy)
    out["toy_stacked"] = {k: list(v) for k, v in names.items() if len(v) > 1}
    w1 = toy.get_parameter("model.layers.0.block_sparse_moe.experts.w1.weight")
    out["toy_local_shape"] = tuple((w1.to_local() if isinstance(w1, DTensor) else w1).shape)
    out["toy"] = state_dict_problems(hp_core.full_state_dict(toy, rank0_only=False), toy_want)
    return out


def _fsdp(model: Any, mesh: Any) -> Any:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def fsdp_export(mode: str) -> dict[str, Any]:
    """dp=2 x tp=2, FSDP2 on dp over hp's tp layout: the export equals one device's."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    base, want = _reference("llama")
    model = copy.deepcopy(base)
    hp_core.apply(model, hp_core.plan(model, mesh), mesh, mode=mode)
    _fsdp(model, mesh)
    key = "model.layers.0.self_attn.q_proj.weight"
    param = model.get_parameter(key)
    return {
        "fsdp_mesh": list(param.device_mesh.mesh_dim_names or ()),
        "problems": state_dict_problems(hp_core.full_state_dict(model, rank0_only=False), want),
        "rank0_only": len(hp_core.full_state_dict(model)),
    }


def gather_paths() -> dict[str, Any]:
    """``full_value`` on each kind of layout, to rank 0 and to every rank, on a 2 x 2 mesh
    whose tp rows list their ranks in reverse (mesh order is not rank order)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hp_core.checkpoint.gather import full_value

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # torch's own uneven sharding disagrees with itself on such a mesh: even pieces only
    backwards = DeviceMesh("cpu", [[1, 0], [3, 2]], mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    whole = torch.randn(6, 4)
    uneven = torch.randn(5, 4)
    cases = {
        "rows": distribute_tensor(whole, mesh["tp"], [Shard(0)]),
        "columns": distribute_tensor(whole, mesh["tp"], [Shard(1)]),
        "rows_backwards": distribute_tensor(whole, backwards["tp"], [Shard(0)]),
        "columns_backwards": distribute_tensor(whole, backwards["tp"], [Shard(1)]),
        "uneven": distribute_tensor(uneven, mesh["tp"], [Shard(0)]),
        "two_dims": distribute_tensor(whole, mesh, [Replicate(), Shard(1)]),
        "replicated": distribute_tensor(whole, mesh["tp"], [Replicate()]),
    }
    out: dict[str, Any] = {}
    for name, dt in cases.items():
        want = uneven if name == "uneven" else whole
        for rank0_only in (True, False):
            got = full_value(dt, None, rank0_only)
            out[f"{name}/{rank0_only}"] = (
                None if got is None else bool(torch.equal(got, want) and got.shape == want.shape)
            )
    return out
