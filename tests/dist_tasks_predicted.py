"""Rank-side task: predicted == measured collectives of one training step, plugins included.

Each case plans a tiny model for a mesh, applies it in production mode and counts every
collective one forward and one backward issue (``hp_core.testing.probe.count_step``);
the prediction is ``step_collectives`` with the mesh's axis sizes, so the plugin items'
declared collectives (CP's K/V gather, EP's all-to-alls) count as well.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from hp_core import plan as make_plan
from hp_core.apply import apply
from hp_core.plans.prediction import input_check_axes, step_collectives
from hp_core.presets import build_model
from hp_core.testing.probe import by_phase, count_step

CP_OVERRIDE = {
    "match": "*.self_attn",
    "when": "cp",
    "inner_target": "self",
    "inner_wrapper": "sdpa_hf",
    "region_dispatch": False,
}
EP_OVERRIDE = {
    "match": "model.layers.*.mlp",
    "when": "ep",
    "local_compute_fn": "qwen2moe",
    "region_dispatch": False,
}

#: name → (world size, mesh shape, mesh names, family, sequence parallel, ep size)
CASES: dict[str, tuple[int, tuple[int, ...], tuple[str, ...], str, bool, int]] = {
    "tp": (2, (2,), ("tp",), "llama", False, 1),
    "tp+sp": (2, (2,), ("tp",), "llama", True, 1),
    "cp": (2, (2,), ("cp",), "llama", True, 1),
    "ep": (2, (2,), ("dp",), "qwen2moe", True, 2),
    "tp+sp x ep": (2, (2,), ("tp",), "qwen2moe", True, 2),
    "cp x tp+sp": (4, (2, 2), ("cp", "tp"), "llama", True, 1),
    "dp x tp+sp x ep": (4, (2, 2), ("dp", "tp"), "qwen2moe", True, 2),
}


def _batch(cp_mesh: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if cp_mesh is None:
        return batch
    from hp_plugin_cp import shard_batch_for_cp  # optional: only the CP cases need the plugin

    return shard_batch_for_cp(batch, cp_mesh)


def _one(name: str) -> dict[str, Any]:
    _world, shape, axes, family, sp, ep = CASES[name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=axes)
    model = build_model(family, seed=0, num_hidden_layers=2)
    overrides = [CP_OVERRIDE] if "cp" in axes else []
    overrides += [EP_OVERRIDE] if ep > 1 else []
    p = make_plan(model, mesh, sequence_parallel=sp, ep_size=ep, overrides=overrides)
    apply(model, p, mesh, mode="production")
    batch = _batch(mesh["cp"] if "cp" in axes else None)
    measured = count_step(lambda: model(**batch, use_cache=False).loss)
    predicted = step_collectives(
        p.modules,
        loss_parallel=p.loss_parallel,
        reductions=model._hp_applied.report.reductions,
        check_axes=input_check_axes(axes, shape),
        sizes=dict(zip(axes, shape, strict=True)),
    )
    return {"measured": measured, "predicted": by_phase(predicted)}


def predicted_and_measured(names: list[str]) -> dict[str, dict[str, Any]]:
    """Per case: the measured and the predicted ``{phase: {op: count}}`` of one step."""
    return {name: _one(name) for name in names}
