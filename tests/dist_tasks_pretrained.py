"""Rank-side tasks of the pretrained-loading tests (importable by the spawned ranks).

Each task meta-builds a tiny family model, plans and applies it on a gloo mesh, loads a
``save_pretrained`` checkpoint of the seeded single-device model with
``hp_core.load_pretrained`` and compares with that model (every parameter, the logits,
the loss, the recomputed rotary buffers). ``hp_core.checkpoint.safetensors_files.read_slice``
is wrapped to record what each rank read.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
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
        def spy(entry: Any, index: tuple[slice, ...]) -> torch.Tensor:
            out = self._orig(entry, index)
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
    plan = hp_core.plan(model, mesh, **plan_kw)
    hp_core.apply(model, plan, mesh, mode=mode)
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
    reference = build_family(family, seed=0, **overrides)
    params = _excess(model, reference)  # before FSDP2 takes the parameters over
    sharded = sorted(
        k
        for k, v in model.state_dict().items()
        if isinstance(v, DTensor) and not all(p.is_replicate() for p in v.placements)
    )
    if fsdp:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
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
        "read_keys": sorted(log.bytes),
        "sharded": sharded,
        "params": params,
        "local_bytes": local_bytes,
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }
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


def _state(model: Any) -> list[tuple[Any, Any, Any]]:
    tensors = [*model.parameters(), *model.buffers()]
    return [(t, t.shape, t.device) for t in tensors]


def _kept(model: Any, before: list[tuple[Any, Any, Any]], error: str | None) -> dict[str, Any]:
    """The error, whether the model's tensors are the same objects of the same shapes and
    devices as ``before``, and whether they are all still on meta."""
    after = _state(model)
    unchanged = len(before) == len(after) and all(
        a[0] is b[0] and a[1] == b[1] and a[2] == b[2] for a, b in zip(before, after, strict=True)
    )
    still_meta = all(
        (t.to_local() if isinstance(t, DTensor) else t).is_meta
        for t in [*model.parameters(), *model.buffers()]
    )
    return {"error": error, "unchanged": unchanged, "still_meta": still_meta}


def _attempt(model: Any, path: str, fail_rank: int | None) -> dict[str, Any]:
    """load_pretrained on ``model`` (its reads of layer 1 failing on ``fail_rank``): the
    error, and whether the model stayed exactly as it was."""
    orig = safetensors_files.read_slice

    def boom(*args: Any) -> Any:
        if dist.get_rank() == fail_rank and "layers.1" in args[0].key:
            raise OSError("disk went away")
        return orig(*args)

    safetensors_files.read_slice = boom
    before = _state(model)
    try:
        hp_core.load_pretrained(model, path)
        error = None
    except hp_core.HpError as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        safetensors_files.read_slice = orig
    return _kept(model, before, error)


def _refusal(path: str, how: str) -> dict[str, Any]:
    mesh = _mesh({"tp": dist.get_world_size()})
    family = "qwen2_moe" if how == "moe" else "llama"
    model = _build(family, mesh, "production", {}, {})
    if how == "materialised":
        model = build_family("llama", seed=0)
        hp_core.apply(model, hp_core.plan(model, mesh), mesh)
    if how == "not_applied":
        model = build_family("llama", device="meta")
    if how == "no_buffer_init":  # an _init_weights that leaves the rotary buffers alone
        model._init_weights = lambda module: None
    # "fail_rank1": rank 1's reads fail mid-way; rank 0's succeed
    return _attempt(model, path, 1 if how == "fail_rank1" else None)


def refusals(cases: dict[str, tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """Per case ``name → (checkpoint path, how)``: the error and whether the model stayed
    exactly as it was (same objects, shapes, devices: still on meta)."""
    out = {name: _refusal(path, how) for name, (path, how) in cases.items()}
    dist.barrier()
    return out


def cast_load(path: str) -> dict[str, Any]:
    """A bf16 checkpoint into an fp32 model with cast=True: the values are the bf16 ones."""
    mesh = _mesh({"tp": dist.get_world_size()})
    model = _build("llama", mesh, "production", {}, {})
    hp_core.load_pretrained(model, path, cast=True)
    reference = build_family("llama", seed=0)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return {
        "params": max(_excess(model, reference).values()),
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }


CP_YAML = """
- match: "*.self_attn"
  when: cp
  inner_target: self
  inner_wrapper: sdpa_hf
  region_dispatch: false
"""


def cp_load(path: str) -> dict[str, Any]:
    """cp=2 (parameters replicated): every rank reads every tensor whole; the cp loss equals
    the single-device loss."""
    from hp_plugin_cp import enable_cp_loss, shard_batch_for_cp  # the cp case only

    mesh = _mesh({"cp": 2})
    model = _build("llama", mesh, "production", {}, {"overrides": CP_YAML})
    with ReadLog() as log:
        hp_core.load_pretrained(model, path)
    enable_cp_loss(model, mesh["cp"])
    reference = build_family("llama", seed=0)
    ids = family_batch("llama", batch=2, seq=16)
    batch = {"input_ids": ids, "labels": ids.clone()}
    with torch.no_grad():
        loss = float(model(**shard_batch_for_cp(batch, mesh["cp"]), use_cache=False).loss)
        ref = float(reference(**batch, use_cache=False).loss)
    total = sum(v.numel() * v.itemsize for v in reference.state_dict().values())
    return {
        "params": max(_excess(model, reference).values()),
        "loss": loss,
        "ref_loss": ref,
        "read_bytes": sum(log.bytes.values()),
        "total_bytes": total,
    }


def persistent_buffer(path: str) -> dict[str, Any]:
    """A persistent buffer (in the checkpoint) loads whole, onto the mesh's device."""
    mesh = _mesh({"tp": dist.get_world_size()})
    with torch.device("meta"):
        model = build_family("llama", device="meta")
        model.model.register_buffer("pos_scale", torch.empty(4), persistent=True)
    hp_core.apply(model, hp_core.plan(model, mesh), mesh)
    hp_core.load_pretrained(model, path)
    return {"value": model.model.pos_scale.tolist(), "device": str(model.model.pos_scale.device)}


def _fsdp_first(family: str, mode: str, overrides: dict, hp_on_tp: bool = False) -> Any:
    """dp=2 x tp=2: meta-build, apply (on the whole mesh, or ``hp_on_tp`` its tp slice),
    fully_shard per decoder layer and on the root."""
    mesh = _mesh({"dp": 2, "tp": 2})
    model = _build(family, mesh["tp"] if hp_on_tp else mesh, mode, overrides, {})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def _loaded_after_fully_shard(path: str, family: str, overrides: dict) -> dict[str, Any]:
    model, mesh = _fsdp_first(family, "production", overrides)
    before = [p for _, p in model.named_parameters(remove_duplicate=False)]
    meta_before = all(p.to_local().is_meta for p in before if isinstance(p, DTensor))
    with ReadLog() as log:
        hp_core.load_pretrained(model, path)
    # Before any forward: FSDP2 keeps the root's parameters unsharded after one.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    after = [p for _, p in model.named_parameters(remove_duplicate=False)]
    unique = {id(p): p for p in after}.values()
    reference = build_family(family, seed=0, **overrides)
    result: dict[str, Any] = {
        "meta_before": meta_before,
        "same_objects": all(a is b for a, b in zip(before, after, strict=True)),
        "all_fsdp": all(isinstance(p, DTensor) and p.device_mesh == mesh["dp"] for p in unique),
        "local_bytes": sum(p.to_local().numel() * p.itemsize for p in unique),
        "model_bytes": sum(p.numel() * p.itemsize for p in reference.parameters()),
        "read_bytes": sum(log.bytes.values()),
        "read_full": sorted(log.full),
        "read": dict(log.bytes),
        "params": _excess(model, reference),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "inv_freq": float(
            (model.model.rotary_emb.inv_freq - reference.model.rotary_emb.inv_freq).abs().max()
        ),
    }
    batch = family_batch(family, batch=2, seq=16)
    with torch.no_grad():
        out = model(input_ids=batch, labels=batch, use_cache=False)
        ref = reference(input_ids=batch, labels=batch, use_cache=False)
    result.update(
        logits=float((_full(out.logits) - ref.logits).abs().max()),
        loss=float(out.loss),
        ref_loss=float(ref.loss),
    )
    # One AdamW step, each dp rank on its half of the batch (FSDP averages over dp): the
    # parameters equal the single-device model's after its step on the whole batch.
    start = {k: v.clone() for k, v in reference.state_dict().items()}
    half = batch[mesh["dp"].get_local_rank() :][:1]
    model(input_ids=half, labels=half, use_cache=False).loss.backward()
    opt.step()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    reference(input_ids=batch, labels=batch, use_cache=False).loss.backward()
    ref_opt.step()
    result["stepped"] = max(_excess(model, reference).values())
    with torch.no_grad():  # the step reached FSDP's storage, which the next forward gathers
        result["loss2"] = float(model(input_ids=batch, labels=batch, use_cache=False).loss)
        result["ref_loss2"] = float(reference(input_ids=batch, labels=batch, use_cache=False).loss)
    result["moved"] = min(
        float((v.detach() - start[k]).abs().max()) for k, v in reference.named_parameters()
    )
    return result


def _unchanged_refusal(
    path: str, mode: str, fail_rank: int | None = None, how: str = ""
) -> dict[str, Any]:
    """A refused load after fully_shard: the error, and whether the model stayed as it was.
    ``how``: "hp_on_tp" (hp applied on the tp slice: FSDP's dp is not in hp's mesh),
    "reshaped" (a parameter swapped for one of another shape before fully_shard)."""
    if how == "reshaped":
        mesh = _mesh({"dp": 2, "tp": 2})
        model = _build("llama", mesh, mode, {}, {})
        attn = model.model.layers[0].self_attn
        attn.q_proj.weight = torch.nn.Parameter(torch.empty(64, 64, device="meta"))
        fully_shard(model, mesh=mesh["dp"])
    else:
        model, _ = _fsdp_first("llama", mode, {}, how == "hp_on_tp")
    return _attempt(model, path, fail_rank)


def load_after_fully_shard(path: str, uneven_path: str, uneven: dict) -> dict[str, Any]:
    """torchtitan's order (apply, fully_shard on meta, load_pretrained) on dp=2 x tp=2:
    llama, a tied llama whose splits are uneven (``uneven``), a read failing on rank 1, and
    validate mode (refused)."""
    out = {
        "untied": _loaded_after_fully_shard(path, "llama", {}),
        "tied_uneven": _loaded_after_fully_shard(uneven_path, "llama", uneven),
        "read_fails": _unchanged_refusal(path, "production", 1, "hp_on_tp"),
        "reshaped": _unchanged_refusal(path, "production", how="reshaped"),
        "validate": _unchanged_refusal(path, "validate"),
    }
    dist.barrier()
    return out


LIST_YAML = """
overrides:
  - match: "model.layers.*.block_sparse_moe"
    when: ep
    local_compute_fn: routed_only
    region_dispatch: false
"""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def hp_stacked_experts(path: str, mode: str) -> dict[str, Any]:
    """A model whose experts are a ``ModuleList`` (hp stacks them into one ``[E, ...]``
    parameter at ep=2): the checkpoint's per-expert keys load into the stacks, each rank
    reading only its own experts; the export gives the checkpoint back."""
    from tests._toy_models import list_moe_lm  # the toy models are test code

    torch.manual_seed(0)
    reference = list_moe_lm()
    want = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    batch = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = reference(batch)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = list_moe_lm()
    hp_core.apply(model, hp_core.plan(model, mesh, ep_size=2, overrides=LIST_YAML), mesh, mode=mode)
    stack = "model.layers.0.block_sparse_moe.experts.w1.weight"
    with ReadLog() as log:
        hp_core.load_pretrained(model, path)
    got = hp_core.full_state_dict(model, rank0_only=False)
    with torch.no_grad():
        after = model(batch)
    experts = sorted(
        int(k.split(".experts.")[1].split(".")[0])
        for k in log.bytes
        if k.startswith("model.layers.0.block_sparse_moe.experts.") and k.endswith("w1.weight")
    )
    return {
        "local_shape": tuple(_local(model.get_parameter(stack)).shape),
        "experts_read": experts,
        "read_whole": sorted(k for k in log.full if ".experts." in k),
        "values": max(float((got[k] - want[k]).abs().max()) for k in want),
        "keys": sorted(got) == sorted(want),
        "logits": float((after - logits).abs().max()),
    }
