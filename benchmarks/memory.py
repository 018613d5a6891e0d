"""Memory: per-rank parameter bytes after apply vs the exact shard size, and peak RSS.

Two jobs of two ranks each (tp=2, gloo) apply the production plan to a Llama (hidden 512,
4 layers, vocab 4096):

* built with real weights: each rank reports the bytes its parameters hold against the
  exact size its shard should have (the replicated parameters plus 1/tp of every sharded
  one), and its peak RSS;
* built on the meta device: the same plan applied to a meta model (what you do before
  loading a checkpoint into the shards), with the rank's peak RSS.

Each job runs in fresh processes, so the peak RSS belongs to that job alone.

    python benchmarks/memory.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

CONFIG = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=4096,
)


def _rank(rank: int, port: int, meta: bool, results: Any) -> None:
    import resource

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from transformers import LlamaConfig, LlamaForCausalLM

    import hp_core

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    full = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    plan = hp_core.plan(model, mesh)
    expected = 0
    for fqn, spec in plan.items():
        for rel, named in (spec.params or {}).items():
            name = f"{fqn}.{rel}" if fqn else rel
            if name in full:
                expected += full[name] // 2 if isinstance(named.get("tp"), Shard) else full[name]
    hp_core.apply(model, plan, mesh, mode="production")
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    results.put(
        {
            "rank": rank,
            "meta": meta,
            "full_bytes": sum(full.values()),
            "held_bytes": held,
            "exact_shard_bytes": expected,
            "peak_rss_mib": peak,
        }
    )
    dist.destroy_process_group()


def _job(meta: bool) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, meta, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = sorted((q.get() for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/memory.json"))
    args = parser.parse_args(argv)
    real, meta = _job(False), _job(True)
    mib = 2**20
    lines = [
        "| rank | full model (MiB) | held after apply (MiB) | exact shard (MiB) | held / exact |",
        "|---|---|---|---|---|",
    ]
    for r in real:
        lines.append(
            f"| {r['rank']} | {r['full_bytes'] / mib:.1f} | {r['held_bytes'] / mib:.1f} | "
            f"{r['exact_shard_bytes'] / mib:.1f} | "
            f"{r['held_bytes'] / r['exact_shard_bytes']:.3f} |"
        )
    lines += [
        "",
        "| rank | peak RSS, real weights: build + apply (MiB) | peak RSS, meta device: build "
        "+ apply (MiB) |",
        "|---|---|---|",
    ]
    for r, m in zip(real, meta, strict=True):
        lines.append(f"| {r['rank']} | {r['peak_rss_mib']:.0f} | {m['peak_rss_mib']:.0f} |")
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"real": real, "meta": meta}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
