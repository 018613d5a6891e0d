"""Rank-side task: a ``region_dispatch: true`` inner wrapper written for plain tensors, run
in both modes under tp=2 (tests/test_plan_time_names.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from hp_core import plan as make_plan
from hp_core.apply import apply
from hp_core.injection import inner_wrapper
from hp_core.testing.families import family_model


@inner_wrapper
def calls_nonzero(target_module, ctx):
    """Calls ``nonzero`` on its first tensor input: fine on a local tensor, an error on a
    DTensor (DTensor has no sharding rule for it)."""
    original = target_module.forward

    def forward(*args, **kwargs):
        x = next(v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        x.nonzero()
        return original(*args, **kwargs)

    return forward


def _run(mode: str, region_dispatch: bool) -> dict[str, Any]:
    model = family_model("llama")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    overrides = [
        {
            "match": "model.layers.0.self_attn",
            "inner_target": "self",
            "inner_wrapper": calls_nonzero,
            "region_dispatch": region_dispatch,
        }
    ]
    apply(model, make_plan(model, mesh, overrides=overrides), mesh, mode=mode)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    try:
        out = model(input_ids=ids, labels=ids, use_cache=False)
    except Exception as e:
        return {
            "type": type(e).__name__,
            "message": str(e),
            "fqn": getattr(e, "fqn", None),
            "name": getattr(e, "name", None),
            "cause": f"{type(e.__cause__).__name__}: {e.__cause__}" if e.__cause__ else None,
        }
    return {"type": None, "finite": bool(torch.isfinite(out.loss).item())}


def region_wrapper_cases() -> dict[str, Any]:
    return {
        "validate_dispatch": _run("validate", True),
        "production_dispatch": _run("production", True),
        "validate_local": _run("validate", False),
    }
