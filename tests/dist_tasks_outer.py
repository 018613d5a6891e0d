"""Rank-side tasks: a data-parallel wrapper over the tp ranks of an hp model is refused."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from hp_core import plan as make_plan
from hp_core.apply import apply
from hp_core.presets import build_model


def ddp_over_world() -> dict[str, Any]:
    """tp=2 over the whole world, then DDP over the default (world) group, as Trainer does."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = build_model("llama")
    apply(model, make_plan(model, mesh), mesh)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = model(input_ids=ids, use_cache=False).logits  # unwrapped: fine
    wrapped = DistributedDataParallel(model)
    try:
        wrapped(input_ids=ids, use_cache=False)
        return {"type": None, "message": "", "plain_ok": plain is not None}
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e), "plain_ok": plain is not None}
