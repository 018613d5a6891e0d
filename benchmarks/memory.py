"""Memory: per-rank parameter bytes after apply vs the exact shard size, and peak RSS.

Two ranks (tp=2, gloo) apply the production plan to a Llama (hidden 512, 4 layers,
vocab 4096) built from real weights; each reports the bytes its parameters hold
against the exact size its shard should have (the replicated parameters plus 1/tp of
every sharded one). A second measurement builds the model on the meta device and applies
the plan there, reporting the process's peak RSS, beside the peak RSS of building the
same model with real weights.

    python benchmarks/memory.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

CONFIG = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=4096)


def _rank(rank: int, port: int, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from transformers import LlamaConfig, LlamaForCausalLM

    import hp_core

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
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
    results.put({"rank": rank, "full_bytes": sum(full.values()), "held_bytes": held, "exact_shard_bytes": expected})
    dist.destroy_process_group()


_META_PROBE = """
import resource, torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(**{cfg})
if {meta}:
    import hp_core
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    hp_core.plan(model, "tp=2")
else:
    model = LlamaForCausalLM(cfg)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/memory.json"))
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    ranks = sorted((q.get() for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    rss = {}
    for label, meta in (("build with real weights", False), ("build on meta + plan", True)):
        out = subprocess.run([sys.executable, "-c", _META_PROBE.format(cfg=CONFIG, meta=meta)], capture_output=True, text=True, check=True)
        rss[label] = int(out.stdout.strip().splitlines()[-1]) / 1024  # KiB -> MiB
    lines = ["| rank | full model (MiB) | held after apply (MiB) | exact shard (MiB) | held / exact |", "|---|---|---|---|---|"]
    for r in ranks:
        mib = lambda b: b / 2**20  # noqa: E731
        lines.append(f"| {r['rank']} | {mib(r['full_bytes']):.1f} | {mib(r['held_bytes']):.1f} | {mib(r['exact_shard_bytes']):.1f} | {r['held_bytes'] / r['exact_shard_bytes']:.3f} |")
    lines += ["", "| process | peak RSS (MiB) |", "|---|---|"] + [f"| {k} | {v:.0f} |" for k, v in rss.items()]
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"ranks": ranks, "peak_rss_mib": rss}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
