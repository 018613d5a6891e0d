"""Rank-side tasks of the pretrained-loading tests (importable by the spawned ranks).

Each task meta-builds a tiny family model, plans and applies it on a gloo mesh, loads a
``save_pretrained`` checkpoint of the seeded single-device model with
``hp_core.load_pretrained`` and compares with that model (every parameter, the logits,
the loss, the recomputed rotary buffers). ``hp_core.checkpoint.safetensors_files.read_slice``
is wrapped to record what each rank read.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import hp_core
from hp_core.checkpoint import safetensors_files
from hp_core.testing.families import build_family, family_batch

EP_YAML = """
overrides:
  - match: "model.layers.*.mlp"
    when: ep
    local_compute_fn: qwen2moe
    region_dispatch: false
"""


class ReadLog:
    """Wraps ``read_slice`` to record the bytes of every slice read (per key)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.full: set[str] = set()  # keys read whole
        self._orig = safetensors_files.read_slice

    def __enter__(self) -> ReadLog:
        def spy(files: Any, entry: Any, index: tuple[slice, ...]) -> torch.Tensor:
            out = self._orig(files, entry, index)
            self.bytes[entry.key] = self.bytes.get(entry.key, 0) + out.numel() * out.itemsize
            if tuple(out.shape) == tuple(entry.shape):
                self.full.add(entry.key)
            return out

        safetensors_files.read_slice = spy
        return self

    def __exit__(self, *exc: object) -> None:
        safetensors_files.read_slice = self._orig


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _excess(model: Any, reference: Any) -> dict[str, float]:
    ref = reference.state_dict()
    return {
        k: float((_full(v).cpu() - ref[k]).abs().max()) if _full(v).numel() else 0.0
        for k, v in model.state_dict().items()
    }


def _mesh(shape: dict[str, int]) -> Any:
    return init_device_mesh("cpu", tuple(shape.values()), mesh_dim_names=tuple(shape))


def _build(family: str, mesh: Any, mode: str, overrides: dict, plan_kw: dict) -> Any:
    with torch.device("meta"):
        model = build_family(family, device="meta", **overrides)
    ids = {id(p) for p in model.parameters()}
    plan = hp_core.plan(model, mesh, **plan_kw)
    hp_core.apply(model, plan, mesh, mode=mode)
    model._test_param_ids = ids  # noqa: SLF001  (ids of the original objects, for identity)
    return model


def load_and_compare(
    path: str,
    family: str,
    mesh_shape: dict[str, int],
    mode: str = "production",
    overrides: dict | None = None,
    ep: int = 1,
    fsdp: bool = False,
) -> dict[str, Any]:
    """Meta-build, plan, apply, load_pretrained; compare with the seed-0 model."""
    overrides = overrides or {}
    mesh = _mesh(mesh_shape)
    plan_kw: dict[str, Any] = {"ep_size": ep, "overrides": EP_YAML} if ep > 1 else {}
    dense = mesh["tp"] if fsdp else mesh
    model = _build(family, mesh, mode, overrides, plan_kw)
    params_before = [p for _, p in model.named_parameters(remove_duplicate=False)]
    meta_before = all(
        (p.to_local() if isinstance(p, DTensor) else p).is_meta for p in params_before
    )
    with ReadLog() as log:
        hp_core.load_pretrained(model, path)
    params_after = [p for _, p in model.named_parameters(remove_duplicate=False)]
    same_objects = all(a is b for a, b in zip(params_before, params_after, strict=True))
    local_bytes = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.itemsize
        for p in {id(p): p for p in params_after}.values()
    )
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    del dense
    reference = build_family(family, seed=0, **overrides)
    batch = family_batch(family, batch=2, seq=16)
    with torch.no_grad():
        out = model(input_ids=batch, labels=batch, use_cache=False)
        ref = reference(input_ids=batch, labels=batch, use_cache=False)
    rotary = getattr(model.model, "rotary_emb", None)
    result: dict[str, Any] = {
        "meta_before": meta_before,
        "same_objects": same_objects,
        "logits": float((_full(out.logits) - ref.logits).abs().max()),
        "loss": float(out.loss),
        "ref_loss": float(ref.loss),
        "inv_freq": float((rotary.inv_freq - reference.model.rotary_emb.inv_freq).abs().max())
        if rotary is not None
        else 0.0,
        "read_bytes": sum(log.bytes.values()),
        "read_full": sorted(log.full),
        "local_bytes": local_bytes,
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }
    if not fsdp:
        result["params"] = _excess(model, reference)
    dist.barrier()
    return result


def perturbed_is_caught(path: str, family: str) -> dict[str, Any]:
    """Negative control: a checkpoint with one perturbed tensor loads, and the comparison
    names that tensor."""
    mesh = _mesh({"tp": dist.get_world_size()})
    model = _build(family, mesh, "production", {}, {})
    hp_core.load_pretrained(model, path)
    excess = _excess(model, build_family(family, seed=0))
    return {"bad": sorted(k for k, v in excess.items() if v > 1e-6)}


def refused(path: str, family: str, how: str, overrides: dict | None = None) -> dict[str, Any]:
    """Try a load that must fail; return the error and whether the model stayed on meta."""
    overrides = overrides or {}
    mesh = _mesh({"tp": dist.get_world_size()})
    model = _build(family, mesh, "production", overrides, {})
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard

        dp = _mesh({"dp": dist.get_world_size()})
        fully_shard(model, mesh=dp)
    if how == "materialised":
        with torch.device("meta"):
            model = build_family(family, seed=0, **overrides)
        hp_core.apply(model, hp_core.plan(model, mesh), mesh)
    if how == "fail_rank1":  # rank 1's reads fail; rank 0's succeed
        orig = safetensors_files.read_slice

        def boom(*args: Any) -> Any:
            if dist.get_rank() == 1:
                raise OSError("disk went away")
            return orig(*args)

        safetensors_files.read_slice = boom
    if how == "not_applied":
        model = build_family(family, device="meta")
    before = [(p, p.shape, p.device) for p in model.parameters()]
    try:
        hp_core.load_pretrained(model, path)
        error = None
    except hp_core.HpError as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        if how == "fail_rank1":
            safetensors_files.read_slice = orig
    after = [(p, p.shape, p.device) for p in model.parameters()]
    unchanged = all(
        a[0] is b[0] and a[1] == b[1] and a[2] == b[2] for a, b in zip(before, after, strict=True)
    )
    dist.barrier()
    return {"error": error, "unchanged": unchanged and len(before) == len(after)}


def expected_bytes(shape: tuple[int, ...], world: int) -> int:
    """Bytes of one ``shape`` float32 tensor split ``world`` ways along dim 0."""
    return math.ceil(shape[0] / world) * math.prod(shape[1:]) * 4
