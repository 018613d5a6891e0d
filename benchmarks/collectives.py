"""Collectives and bytes per training step: hp vs the theoretical minimum, per plan.

Plans: TP, TP+SP, CP, TPxCP, EP and TPxEP on tiny real HF models (2 decoder layers,
batch 2, sequence 16). Each runs one forward + backward on real gloo ranks and counts
every collective (op, and the bytes each rank contributes) with a dispatch-level probe.
The minimum is what the parallel scheme needs at all, written out independently of hp's
planner:

* TP (Megatron): per layer 2 all-reduce forward, 2 backward; plus the vocab-parallel
  embedding's all-reduce, the lm_head's gather of the logits, and the all-reduce of the
  lm_head input's (partial) gradient.
* SP: each all-reduce becomes an all-gather + reduce-scatter pair; plus one bucketed
  all-reduce of the norm gradients per step.
* CP: per layer one all-gather of K and V together forward, one reduce-scatter backward;
  plus one scalar all-reduce of the loss and one bucketed gradient all-reduce (hp runs it
  itself at the end of backward).
* EP: per MoE layer an all-to-all of counts, of tokens and back forward; tokens and back
  backward.

Measured with ``apply(check_inputs=False)``: the input check (one small all-reduce per
non-dp axis and forward) guards against mismatched batches and is not part of a scheme.

    python benchmarks/collectives.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from hp_core.testing.probe import CollectiveCounter

LAYERS = 2


def _step(model: Any, batch: dict[str, Any]) -> tuple[dict[str, int], int]:
    with CollectiveCounter() as probe:
        loss = model(**batch, use_cache=False).loss
        loss.backward()
    return probe.calls, probe.bytes


def run_case(case: str) -> dict[str, Any]:
    """One plan, on the calling rank (world 4: every mesh below is 2 x 2)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import hp_core
    from hp_core.testing import build_model

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    batch: dict[str, Any] = {"input_ids": ids, "labels": ids}
    cp_yaml = [
        {
            "match": "*.self_attn",
            "when": "cp",
            "inner_target": "self",
            "inner_wrapper": "sdpa_hf",
            "region_dispatch": False,
        }
    ]
    moe_yaml = [
        {
            "match": "model.layers.*.mlp",
            "when": "ep",
            "local_compute_fn": "qwen2moe",
            "region_dispatch": False,
        }
    ]
    family, names, sp, ep, overrides = {
        "TP": ("llama", ("dp", "tp"), False, 1, None),
        "TP+SP": ("llama", ("dp", "tp"), True, 1, None),
        "CP": ("llama", ("dp", "cp"), False, 1, cp_yaml),
        "TPxCP": ("llama", ("cp", "tp"), True, 1, cp_yaml),
        "EP": ("qwen2moe", ("dp", "tp"), True, 2, moe_yaml),
        "TPxEP": ("qwen2moe", ("dp", "tp"), True, 4, moe_yaml),
    }[case]
    model = build_model(family, seed=0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    if case == "EP":  # experts over the two dp ranks only: a dp-only dense mesh
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        ep = 2
    plan = hp_core.plan(model, mesh, sequence_parallel=sp, ep_size=ep, overrides=overrides)
    # Without the input check: its one small all-reduce per axis and forward is a safety
    # check, not part of the scheme (step_overhead.py times the default, check included).
    hp_core.apply(model, plan, mesh, check_inputs=False)
    if "cp" in names:
        from hp_plugin_cp import enable_cp_loss, shard_batch_for_cp

        enable_cp_loss(model, mesh["cp"])
        batch = shard_batch_for_cp(batch, mesh["cp"])
    _step(model, batch)  # warm-up (first-call setup)
    model.zero_grad(set_to_none=True)
    calls, sent = _step(model, batch)
    return {"rank": dist.get_rank(), "calls": calls, "bytes": sent}


def minimum(case: str) -> dict[str, int]:
    """Collectives per step the scheme needs at all (forward + backward), from the formulas
    above."""
    n = LAYERS
    tp = {"all_reduce": 4 * n + 2, "all_gather": 1}
    sp = {"all_gather": 4 * n + 3, "reduce_scatter": 4 * n + 1, "all_reduce": 2}
    cp = {"all_gather": n, "reduce_scatter": n, "all_reduce": 2}
    ep = {"all_to_all": 5 * n}
    table = {
        "TP": tp,
        "TP+SP": sp,
        "CP": cp,
        "TPxCP": {k: sp.get(k, 0) + cp.get(k, 0) for k in set(sp) | set(cp)},
        "EP": ep,
        "TPxEP": {
            **{
                k: v - (2 * n if k in ("all_gather", "reduce_scatter") else 0)
                for k, v in sp.items()
            },
            **ep,
        },
    }
    return table[case]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/collectives.json"))
    parser.add_argument("--cases", nargs="+", default=["TP", "TP+SP", "CP", "TPxCP", "EP", "TPxEP"])
    args = parser.parse_args(argv)
    from hp_core.testing import get_world, shutdown_worlds

    rows = []
    try:
        for case in args.cases:
            r = get_world(4).run(run_case, case)[0]
            rows.append(
                {
                    "plan": case,
                    "measured": r["calls"],
                    "bytes_per_rank": r["bytes"],
                    "minimum": minimum(case),
                }
            )
    finally:
        shutdown_worlds()
    lines = [
        "| plan | collectives measured | theoretical minimum | measured / minimum | KiB sent "
        "per rank |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        fmt = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items()))  # noqa: E731
        m, mn = sum(r["measured"].values()), sum(r["minimum"].values())
        lines.append(
            f"| {r['plan']} | {fmt(r['measured'])} | {fmt(r['minimum'])} | {m}/{mn} = "
            f"{m / mn:.2f} | {r['bytes_per_rank'] / 1024:.1f} |"
        )
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
