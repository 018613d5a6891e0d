"""Rank-side tasks: full-width q/k norms on a tp-sharded projection match one device.

A case plans a tiny OLMo-2 / OLMo-3 / OLMoE for ``tp`` (optionally with ep=2 experts),
verifies it (no collective), applies it in both modes and trains 2 AdamW steps next to a
single-device copy, comparing loss, logits and every gradient. The first step's
collectives are counted in both modes and returned with the plan's prediction.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from hp_core import apply, plan, verify
from hp_core.planner.sharded_norm import SHARDED_QK_NORM, _ShardedNorm, _WithShardedNorms
from hp_core.plans.prediction import input_check_axes, plugin_collectives, step_collectives
from hp_core.testing.compare import (
    gather_full_grads,
    nan_safe_max,
    run_excess,
    snapshot_params,
    unmoved_params,
)
from hp_core.testing.families import build_family, family_batch
from hp_core.testing.probe import CollectiveCounter, by_phase

RTOL = 1e-5
STEPS = 2
EP_OVERRIDE = {
    "match": "model.layers.*.mlp",
    "local_compute_fn": "routed_only",
    "region_dispatch": False,
}


def _norm_calls(p: Any, sizes: dict[str, int]) -> dict[str, dict[str, int]]:
    """What the plan says the sharded norms issue per step (the inner wrapper's declaration)."""
    counts: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
    for fqn, spec in p.modules.items():
        for c in plugin_collectives(fqn, spec, sizes):
            if SHARDED_QK_NORM in c.where:
                counts[c.phase][c.op] = counts[c.phase].get(c.op, 0) + 1
    return counts


def _count(m: nn.Module, ids: torch.Tensor) -> tuple[Any, dict[str, dict[str, int]]]:
    with CollectiveCounter() as fwd:
        out = m(input_ids=ids, labels=ids, use_cache=False)
    with CollectiveCounter() as bwd:
        out.loss.backward()
    return out, {"forward": dict(fwd.calls), "backward": dict(bwd.calls)}


def _local_only_norms(m: nn.Module) -> int:
    """Negative control: every sharded norm normalizes its shard alone (no reduction)."""
    n = 0
    for bf in m._hp_applied.forwards.values():
        if isinstance(bf.compute, _WithShardedNorms):
            n += len(bf.compute.norms)
            bf.compute.norms = {}
    return n


def qk_norm_case(
    family: str, tp: int, sp: bool, ep: int = 1, control: str | None = None
) -> dict[str, Any]:
    """Plan, verify, apply both modes, train 2 steps against one device; counts and excesses."""
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    extra = {"num_key_value_heads": 4} if tp == 4 else {}
    base = build_family(family, seed=0, **extra)
    p = plan(
        base, mesh, sequence_parallel=sp, ep_size=ep, overrides=[EP_OVERRIDE] if ep > 1 else None
    )
    with CollectiveCounter() as comm:
        report = verify(base, p, mesh)
    models = {"ref": copy.deepcopy(base), "prod": copy.deepcopy(base), "val": copy.deepcopy(base)}
    apply(models["prod"], p, mesh, verify=report)
    apply(models["val"], p, mesh, mode="validate", verify=report)
    removed = _local_only_norms(models["prod"]) if control == "local_norm" else 0
    sizes = {"tp": tp}
    predicted = by_phase(
        step_collectives(
            p.modules,
            loss_parallel=p.loss_parallel,
            reductions=report.reductions,
            check_axes=input_check_axes(("tp",), (tp,)),
            sizes=sizes,
        )
    )
    opts = {
        k: torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-5, foreach=False)
        for k, m in models.items()
    }
    worst: dict[str, float] = {}
    unmoved: dict[str, set[str]] = {k: set() for k in models}
    measured: dict[str, Any] = {}
    for step in range(STEPS):
        ids = family_batch(family, seed=step)
        res: dict[str, Any] = {}
        for k, m in models.items():
            opts[k].zero_grad(set_to_none=True)
            out, calls = _count(m, ids)
            if step == 0:
                measured[k] = calls
            groups = m._hp_applied.expert_meshes if k != "ref" and ep > 1 else None
            grads = (
                {n: q.grad for n, q in m.named_parameters()}
                if k == "ref"
                else gather_full_grads(m, models["ref"], mesh, expert_groups=groups)
            )
            res[k] = (out.loss.detach(), out.logits.detach(), grads)
        for a, b in (("prod", "ref"), ("val", "ref"), ("prod", "val")):
            for what, value in run_excess(res[a], res[b], rtol=RTOL).items():
                key = f"{a}-{b}:{what}"
                worst[key] = nan_safe_max([worst.get(key, 0.0), value])
        for k, m in models.items():
            before = snapshot_params(m, only_with_grad=True)
            opts[k].step()
            unmoved[k].update(unmoved_params(before, m))
    attn = p["model.layers.0.self_attn"]
    return {
        "excess": worst,
        "unmoved": {k: sorted(v) for k, v in unmoved.items()},
        "n_grads": len(res["ref"][2]),
        "verify_collectives": comm.total(),
        "measured": {k: measured[k] for k in ("prod", "val")},
        "predicted": predicted,
        "norm_calls": _norm_calls(p, sizes),
        "explain": p.explain(),
        "layers": base.config.num_hidden_layers,
        "removed": removed,
        "norm_layouts": {
            rel: str(attn.params[rel]["tp"]) for rel in ("q_norm.weight", "k_norm.weight")
        },
        "local_norm_shape": tuple(models["prod"].model.layers[0].self_attn.q_norm.weight.shape),
    }


def norm_dtypes() -> dict[str, Any]:
    """A bf16 input through each family's own q_norm, sharded over tp=2 and whole.

    The sharded norm runs the module's own forward, so it upcasts, normalizes and casts
    back exactly where the module does: OLMo-2 returns bf16, OLMoE (weight x bf16) fp32.
    """
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank = mesh.get_local_rank()
    out: dict[str, Any] = {}
    for family in ("olmo2", "olmoe"):
        norm = build_family(family, seed=0, num_hidden_layers=1).model.layers[0].self_attn.q_norm
        width = int(norm.weight.shape[0])
        g = torch.Generator().manual_seed(1)
        x = (3 * torch.randn(2, 5, width, generator=g)).to(torch.bfloat16)
        whole = norm(x)
        shard = copy.deepcopy(norm)
        shard.weight = nn.Parameter(norm.weight.detach().chunk(2)[rank].clone())
        fqn = "model.layers.0.self_attn.q_norm"
        y = _ShardedNorm(fqn, shard, shard.forward, width, mesh.get_group())(x.chunk(2, -1)[rank])
        expected = whole.chunk(2, -1)[rank]
        out[family] = {
            "dtypes": (str(y.dtype), str(whole.dtype)),
            "max_diff": (y.float() - expected.float()).abs().max().item(),
            "ulp": expected.float().abs().max().item() * 2.0**-7,  # one bf16 step at the top
        }
    return out
