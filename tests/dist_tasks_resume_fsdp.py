"""Rank-side tasks of the FSDP2 resume test: hp on tp, FSDP2 on dp, model + AdamW resumed.

The optimizer's moments under FSDP2 are FSDP's DTensors over dp of hp's local shard; hp's
optimizer hooks turn them into one DTensor over dp and tp (the same views as the
parameters'), so the checkpoint resumes at tp-only layouts, in one process and back.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.dist_tasks_resume import (
    SAVE_AT,
    _batches,
    _loss_rel,
    _moments,
    _optimizer,
    _reference,
    _rel,
    _resumed,
    _save,
    _train,
)
from tests.dist_tasks_resume import _applied as _hp_applied


def _fsdp_applied(seed: int, mesh: DeviceMesh) -> nn.Module:
    model = _hp_applied("llama", seed, mesh, "production")
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def fsdp_save_and_resume(path: str, tp2_path: str) -> dict[str, Any]:
    """Steps 1-3 at dp=2 x tp=2 under FSDP2 (saved to ``path``); a fresh FSDP2 model resumes
    from it, and another from a tp=2 checkpoint (``tp2_path``): steps 4-6 match one device.
    Every dp rank trains on the same batches, so FSDP's mean over dp is the one-device step."""
    ref = _reference("llama")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _fsdp_applied(0, mesh)
    opt = _optimizer(model)
    losses = _train(model, opt, _batches("llama")[:SAVE_AT])
    out: dict[str, Any] = {
        "losses": _loss_rel(losses, ref["losses"][:SAVE_AT]),
        "moments": _rel(_moments(model, opt), ref["moments"]),
    }
    _save(path, model, opt)
    out["resumed"] = _resumed(path, _fsdp_applied(1, mesh), ref)
    out["from_tp2"] = _resumed(tp2_path, _fsdp_applied(1, mesh), ref)
    return out
