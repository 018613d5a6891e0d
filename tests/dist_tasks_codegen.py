"""Rank-side task for the codegen test: a plan rebuilt from an artifact == the live plan."""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

from hp_core import plan as make_plan
from hp_core.apply import apply
from hp_core.artifact import dumps_artifact, loads_artifact, make_artifact, plan_differences
from hp_core.testing.compare import gather_full_grads, max_abs_diff, nan_safe_max
from hp_core.testing.families import family_model


def rebuilt_vs_live(family: str = "llama") -> dict:
    """Apply the live plan and the plan rebuilt from its artifact (both modes); compare one step.

    Returns the worst absolute differences of loss, logits and gradients between the
    rebuilt and the live plan per mode, and against a single-device reference (NaN-safe:
    a NaN or a shape mismatch is inf). The weights are perturbed by seeded noise and the
    parallel gradients gathered without hp's placement tables.
    """
    base = family_model(family)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    live = make_plan(base, mesh)
    data = dumps_artifact(make_artifact(live, model=base))
    artifact = loads_artifact(data, check_registry=True)
    rebuilt = artifact.plan(model=base)
    models = {"ref": copy.deepcopy(base)}
    for mode in ("production", "validate"):
        for name, p in (("live", live), ("rebuilt", rebuilt)):
            models[f"{name}-{mode}"] = apply(copy.deepcopy(base), p, mesh, mode=mode)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    res = {}
    for key, m in models.items():
        out = m(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        if key != "ref":
            grads = gather_full_grads(m, models["ref"], mesh)
        res[key] = {"loss": out.loss.detach().reshape(1), "logits": out.logits.detach()}, grads

    def worst(a: str, b: str) -> dict[str, float]:
        (oa, ga), (ob, gb) = res[a], res[b]
        return {
            "loss": nan_safe_max(max_abs_diff(oa, ob).values()),
            "grads": nan_safe_max(max_abs_diff(ga, gb).values()),
        }

    return {
        "differences": plan_differences(live, rebuilt),
        "signature": artifact.signature,
        "n_grads": len(res["ref"][1]),
        "n_params": len(list(base.parameters())),
        **{
            f"{mode}:rebuilt-live": worst(f"rebuilt-{mode}", f"live-{mode}")
            for mode in ("production", "validate")
        },
        **{
            f"{mode}:rebuilt-ref": worst(f"rebuilt-{mode}", "ref")
            for mode in ("production", "validate")
        },
    }
