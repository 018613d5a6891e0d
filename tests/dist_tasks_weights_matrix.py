"""Rank-side task of the weights matrix: every family the planner takes loads and exports.

For each family of the differential matrix: the seeded single-device model is written
with ``save_pretrained`` (rank 0), the same config is built on the meta device, planned
for tp=2 (following the overrides a refusal proposes, as the training matrix does),
applied, filled with ``hp_core.load_pretrained``; its logits must equal the single-device
model's, greedy ``generate()`` (production) its tokens, ``hp_core.full_state_dict`` must
give back the saved state dict, and its DCP checkpoint must load into one whole model in
one process with the same values.
A family the planner refuses is recorded as refused (issue 14's ground), never as loaded.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hp_core
from hp_core import HpError
from hp_core.runtime.state_dict import ShardedStateDict
from hp_core.testing.families import build_family, family_batch
from tests.dist_tasks_matrix import proposed_overrides

#: The mode name of the FSDP2 pass: production on dp=2 x tp=2, ``fully_shard`` on dp
#: (the root) before ``load_pretrained``.
FSDP2 = "fsdp2"


def _applied(family: str, mesh: Any, mode: str) -> tuple[Any, str | None]:
    """The family built on meta and applied at tp=2, following the overrides refusals
    propose (as the training matrix does); or the last refusal."""
    overrides: list[dict[str, Any]] = []
    for _ in range(4):
        model = build_family(family, device="meta")
        try:
            plan = hp_core.plan(model, mesh, sequence_parallel=False, overrides=overrides or None)
            hp_core.apply(model, plan, mesh, mode=mode)
            return model, None
        except HpError as e:
            refusal = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            fix = proposed_overrides(str(e))  # this pass is without sequence parallelism
            if fix is None or all(entry in overrides for entry in fix):
                return None, refusal
            overrides += [entry for entry in fix if entry not in overrides]
    return None, refusal


def _one(family: str, root: str, mesh: Any, modes: tuple[str, ...]) -> dict[str, Any]:
    path = os.path.join(root, family)
    reference = build_family(family, seed=0)
    ids = family_batch(family, batch=2, seq=16)
    with torch.no_grad():
        want = reference(input_ids=ids, use_cache=False).logits
    saved = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    prompt = ids[:1, :8]
    # Greedy tokens through the KV cache: only the production pass decodes.
    tokens = (
        reference.generate(prompt, max_new_tokens=4, do_sample=False)
        if "production" in modes
        else None
    )
    if dist.get_rank() == 0:
        reference.save_pretrained(path)
    dist.barrier()
    out: dict[str, Any] = {}
    for mode in modes:
        model, refused = _applied(family, mesh, "production" if mode == FSDP2 else mode)
        if model is not None and mode == FSDP2:  # torchtitan's order: fully_shard on meta
            fully_shard(model, mesh=mesh["dp"])
        if model is None:
            out[mode] = {"refused": refused}
            continue
        out[mode] = _loaded(model, path, ids, want, saved, mode)
        if mode == "production":
            out[mode]["signature"] = layout_signature(model)
        if mode == "production" and "load_error" not in out[mode]:  # KV-cache decoding
            got = model.generate(prompt, max_new_tokens=4, do_sample=False)
            out[mode]["generate"] = bool(torch.equal(got, tokens))
    return out


def layout_signature(model: Any) -> list[str]:
    """What loading into ``model`` under FSDP2 depends on, per parameter, in words: its rank
    (ndim), its tp placements, whether a fused re-arrangement moves rows (and along which
    dim), and whether its local shard's first dim (the one ``fully_shard`` splits) divides
    by dp=2. Names are left out: two families with the same descriptors exercise the same
    slicing of FSDP's piece, whatever their parameters are called."""
    hooks = [getattr(h, "__self__", None) for h in model._state_dict_hooks.values()]
    sharded = next((h for h in hooks if isinstance(h, ShardedStateDict)), None)
    layouts = sharded.layouts if sharded is not None else {}
    out = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        layout = layouts.get(name)
        if layout is None:
            out.add(f"{p.dim()}d replicated even={p.shape[0] % 2 == 0 if p.dim() else True}")
            continue
        moves = layout.fused is not None and layout.fused.moves
        fused = f" fused-dim{layout.fused.layout.dim}" if moves and layout.fused else ""
        placements = ",".join(repr(x) for x in layout.placements)
        out.add(f"{p.dim()}d {placements}{fused} even={p.shape[0] % 2 == 0 if p.dim() else True}")
    tied = len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.parameters()))
    return sorted(out | ({"tied"} if tied else set()))


def _dcp_to_one_process(model: Any, family: str, path: str, saved: dict[str, Any]) -> float | None:
    """The model's DCP checkpoint (its state dict carries the layouts) loaded into one whole
    model in one process (rank 0): the worst difference from ``saved``."""
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    worst = None
    if dist.get_rank() == 0:
        whole = build_family(family, seed=1)  # other weights until loaded
        state = whole.state_dict()
        dcp.load(state, checkpoint_id=path, no_dist=True)
        whole.load_state_dict(state)
        got = whole.state_dict()
        worst = max(float((got[k] - saved[k]).abs().max()) for k in saved)
    dist.barrier()
    return worst


def _loaded(
    model: Any,
    path: str,
    ids: torch.Tensor,
    want: torch.Tensor,
    saved: dict[str, torch.Tensor],
    mode: str,
) -> dict[str, Any]:
    try:
        hp_core.load_pretrained(model, path)
    except HpError as e:
        return {"load_error": f"{type(e).__name__}: {e}"}
    model.eval()
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
    exported = hp_core.full_state_dict(model, rank0_only=False)
    values = max(
        (float((exported[k] - saved[k]).abs().max()) for k in saved if k in exported),
        default=float("inf"),
    )
    family = os.path.basename(path)
    return {
        "logits": float((got - want).abs().max()),
        "dcp": _dcp_to_one_process(model, family, f"{path}-dcp-{mode}", saved),
        "export_missing": sorted(set(saved) - set(exported)),
        "export_extra": sorted(set(exported) - set(saved)),
        "export_values": values,
    }


def weights_matrix(
    root: str, families: list[str], modes: tuple[str, ...]
) -> dict[str, dict[str, Any]]:
    """Every family in ``families``, in each mode: loaded and exported at tp=2 (a world of 2)
    or at dp=2 x tp=2 under FSDP2 (a world of 4, mode ``FSDP2``), or refused."""
    if dist.get_world_size() == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out: dict[str, dict[str, Any]] = {}
    for family in families:
        try:
            out[family] = _one(family, root, mesh, modes)
        except Exception as e:  # a crash is a finding: report it, keep the others going
            out[family] = {"crash": f"{type(e).__name__}: {str(e)[:500]}"}
        dist.barrier()
    return out


def perturbed_family(root: str, family: str) -> dict[str, Any]:
    """``_one``'s comparison on a checkpoint whose embedding was perturbed after saving."""
    from safetensors.torch import load_file, save_file  # the hf extra

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    path = os.path.join(root, family)
    reference = build_family(family, seed=0)
    ids = family_batch(family, batch=2, seq=16)
    with torch.no_grad():
        want = reference(input_ids=ids, use_cache=False).logits
    saved = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    if dist.get_rank() == 0:
        reference.save_pretrained(path)
        file = os.path.join(path, "model.safetensors")
        tensors = load_file(file)
        key = next(k for k in tensors if "embed_tokens" in k)
        tensors[key] = tensors[key] + 0.01
        save_file(tensors, file, metadata={"format": "pt"})
    dist.barrier()
    model, refused = _applied(family, mesh, "production")
    if model is None:
        raise RuntimeError(f"{family} was refused: {refused}")
    return _loaded(model, path, ids, want, saved, "production")
