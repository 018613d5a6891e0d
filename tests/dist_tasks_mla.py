"""Rank-side tasks for MLA, per-head parameters and blocks kept whole (tests/test_mla_per_head.py).

Each case plans a tiny seeded family with zero configuration, verifies it (no collective),
applies it in both modes and trains 2 AdamW steps next to a single-device copy with the
differential matrix's own loop; the others look at one gradient or one parameter.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hp_core import HpError, apply, plan, verify
from hp_core.testing.compare import GradientCheckError, gather_full_grads, run_excess
from hp_core.testing.families import build_family, family_batch
from hp_core.testing.probe import CollectiveCounter
from tests.dist_tasks_matrix import _train

KV_A = "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight"


def _mesh(tp: int) -> Any:
    return init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))


def matched(
    family: str, sp: bool, config: dict[str, Any] | None = None, tp: int = 2
) -> dict[str, Any]:
    """Zero-config plan → verify → both modes → 2 AdamW steps against one device."""
    mesh = _mesh(tp)
    base = build_family(family, seed=0, **(config or {}))
    p = plan(base, mesh, sequence_parallel=sp)
    with CollectiveCounter() as comm:
        report = verify(base, p, mesh)
    models = {"ref": copy.deepcopy(base), "prod": copy.deepcopy(base), "val": copy.deepcopy(base)}
    apply(models["prod"], p, mesh, verify=report)
    apply(models["val"], p, mesh, mode="validate", verify=report)
    out = _train(models, family, mesh)
    specs = {
        k: v for k, v in p.modules.items() if k.startswith(("model.layers.0.", "model.layers.1."))
    }
    return {
        **out,
        "collectives": comm.total(),
        "partial": sorted(report.partial()),
        "params": {k: {r: str(n.get("tp")) for r, n in v.params.items()} for k, v in specs.items()},
        "notes": list(p.notes),
        "local": {
            n: list(t.to_local().shape if isinstance(t, DTensor) else t.shape)
            for n, t in models["prod"].named_parameters()
            if n.startswith("model.layers.0.self_attn.")
        },
    }


def k_pe_rows(family: str, drop: bool, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """One backward: how far the gathered gradient of ``kv_a_proj_with_mqa`` is from one
    device's, split into its latent rows and its rope-key (k_pe) rows, in both modes — with
    the derived reduction of that weight kept or dropped from the verifier's report."""
    mesh = _mesh(2)
    base = build_family(family, seed=0, **(config or {}))
    lora = base.config.kv_lora_rank
    p = plan(base, mesh)
    report = verify(base, p, mesh)
    kv = {KV_A.format(i) for i in range(base.config.num_hidden_layers)}
    res: dict[str, Any] = {"derived": sorted(set(report.partial()) & kv)}
    if drop:
        report = dataclasses.replace(
            report, reductions=tuple(r for r in report.reductions if r.param not in kv)
        )
    ids = family_batch(family, seed=0)
    ref = copy.deepcopy(base)
    ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    name = KV_A.format(0)
    want = ref.get_parameter(name).grad
    for mode in ("production", "validate"):
        m = copy.deepcopy(base)
        apply(m, p, mesh, mode=mode, verify=report)
        try:
            m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        except HpError as e:  # validate's own checks may catch a dropped reduction first
            res[mode] = {"caught": type(e).__name__}
            continue
        g = m.get_parameter(name).grad
        got = g.to_local() if isinstance(g, DTensor) else g  # replicated: the whole gradient
        res[mode] = {
            "latent": (got[:lora] - want[:lora]).abs().max().item(),
            "k_pe": (got[lora:] - want[lora:]).abs().max().item(),
            "scale": want[lora:].abs().max().item(),
        }
        try:  # the independent gatherer compares the replicas too
            gather_full_grads(m, ref, mesh)
            res[mode]["gather"] = "ok"
        except GradientCheckError as e:
            res[mode]["gather"] = str(e)[:300]
    return res


def without_broadcast_rule(family: str) -> dict[str, Any]:
    """The verifier without hp's broadcast rule (MLA's shared rope key is then re-sliced by
    DTensor, and its gradient all-gathered): must refuse, not pass."""
    from hp_core.runtime import boundary

    class _Off(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    saved = boundary.BroadcastToShards
    boundary.BroadcastToShards = _Off  # type: ignore[misc]
    try:
        base = build_family(family, device="meta")
        p = plan(base, "tp=2")
        try:
            verify(base, p)
        except HpError as e:
            return {"refused": type(e).__name__, "message": str(e)[:400]}
        return {"refused": None}
    finally:
        boundary.BroadcastToShards = saved  # type: ignore[misc]


def with_experts(family: str, sp: bool) -> dict[str, Any]:
    """tp=2 with ep=2 (hp-plugin-moe's compute for the architecture): MLA attention and the
    routed experts sharded together; one step's loss, logits and every gradient against
    one device, in both modes, and each rank's share of the experts."""
    mesh = _mesh(2)
    base = build_family(family, seed=0)
    moe = [
        {
            "match": "model.layers.1.mlp",  # layer 0 is dense (first_k_dense_replace)
            "when": "ep",
            "local_compute_fn": "deepseekv3",
            "region_dispatch": False,
        }
    ]
    ids = family_batch(family, seed=0)
    ref = copy.deepcopy(base)
    out = ref(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    expected = (
        out.loss.detach(),
        out.logits.detach(),
        {n: p.grad for n, p in ref.named_parameters()},
    )
    p = plan(base, mesh, sequence_parallel=sp, ep_size=2, overrides=moe)
    res: dict[str, Any] = {}
    for mode in ("production", "validate"):
        m = copy.deepcopy(base)
        apply(m, p, mesh, mode=mode)
        got = m(input_ids=ids, labels=ids, use_cache=False)
        got.loss.backward()
        grads = gather_full_grads(m, ref, mesh, expert_groups=m._hp_applied.expert_meshes)
        res[mode] = run_excess((got.loss.detach(), got.logits.detach(), grads), expected)
        experts = [n for n, t in m.named_parameters() if ".experts." in n]
        res[f"{mode}:experts"] = {
            n: list((t.to_local() if isinstance(t, DTensor) else t).shape)
            for n in experts
            for t in [m.get_parameter(n)]
        }
    return res
