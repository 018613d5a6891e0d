"""Rank-side tasks for the models written outside transformers (hp_core.testing.external_models).

Each model is planned at tp=2 with no configuration at all, verified (no collective),
applied in both modes and trained 2 AdamW steps next to a single-device copy, exactly as
the differential matrix does for Hugging Face families; or its refusal is recorded.
"""

from __future__ import annotations

import copy
from typing import Any

from torch.distributed.device_mesh import init_device_mesh

from hp_core import HpError, apply, plan, verify
from hp_core.testing.compare import GradientCheckError
from hp_core.testing.external_models import build_external, external_batch
from hp_core.testing.probe import CollectiveCounter
from tests.dist_tasks_matrix import _train


def external_case(name: str, sp: bool, control: str | None = None) -> dict[str, Any]:
    """Plan, verify, apply both modes, train; or the refusal (type, message)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    base = build_external(name)
    try:
        p = plan(base, mesh, sequence_parallel=sp)
        with CollectiveCounter() as comm:
            report = verify(base, p, mesh)
    except HpError as e:
        return {"refused": type(e).__name__, "message": str(e)}
    models = {"ref": copy.deepcopy(base), "prod": copy.deepcopy(base), "val": copy.deepcopy(base)}
    apply(models["prod"], p, mesh, verify=report)
    apply(models["val"], p, mesh, mode="validate", verify=report)
    if control == "no_reductions":  # the runtime forgets the derived gradient sums
        for k in ("prod", "val"):
            models[k]._hp_applied.grad_reducer.buckets = []
    try:
        result = _train(models, name, mesh, batch=lambda seed: external_batch(seed=seed))
    except (GradientCheckError, HpError) as e:  # caught by the comparison or validate's checks
        return {"caught": type(e).__name__, "message": str(e)[:2000]}
    kinds = sorted({s.is_boundary for s in p.modules.values()})
    return {**result, "collectives": comm.total(), "boundaries": len(p.modules), "kinds": kinds}


def external_cases(cases: list[tuple[str, bool]]) -> list[dict[str, Any]]:
    return [external_case(name, sp) for name, sp in cases]
