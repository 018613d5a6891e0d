"""Memory of the full export: peak RSS per rank of ``hp_core.iter_full_state_dict`` at tp=2.

A Llama shaped like a ~110 M-parameter model with a tiny hidden size and many layers
(hidden 256, 96 layers, vocab 32000, fp32: ~440 MB whole) is built on the meta device,
applied at tp=2 (production, gloo) and its local shards materialised, so before the export
a rank holds its shard and nothing else. Then it is exported twice, each in fresh
processes (peak RSS is a high-water mark):

* ``stream``: ``iter_full_state_dict`` on rank 0, each tensor dropped after use (what a
  writer of one file per tensor, or of safetensors shards, does);
* ``dict``: ``full_state_dict`` on rank 0, for comparison: rank 0 holds the whole model.

Reported per rank: the process baseline (RSS before the shard is materialised), the shard
bytes, the largest full tensor, the peak RSS, and ``peak / (baseline + shard)``. The stream
stays near ``baseline + shard + one full tensor`` on rank 0; the tp pieces are gathered to
rank 0, so rank 1 stays at ``baseline + shard``.

    python benchmarks/export_memory.py [--layers 96 --hidden 256 --vocab 32000] [--json out]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MIB = 2**20


def _config(layers: int, hidden: int, vocab: int) -> dict[str, Any]:
    return dict(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(rank: int, port: int, how: str, config: dict[str, Any], results: Any) -> None:
    import resource

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    import hp_core

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    hp_core.apply(model, hp_core.plan(model, mesh), mesh, mode="production")
    baseline = _rss()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    # production parameters are the local shards (the state dict's DTensor views say global)
    shard = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    dist.barrier()
    start = time.perf_counter()
    count = 0
    if how == "stream":
        for _name, tensor in hp_core.iter_full_state_dict(model):
            count += 1
            del tensor
    else:
        whole = hp_core.full_state_dict(model)
        count = len(whole)
    seconds = time.perf_counter() - start
    # The kernel's high-water mark is only raised when memory is unmapped, so memory the
    # allocator returned by madvise can leave it below an RSS this rank was seen to have:
    # the peak is the largest of it and the two samples taken here (a lower bound).
    high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    peak = max(high_water, baseline, _rss())
    results.put(
        {
            "rank": rank,
            "how": how,
            "tensors": count,
            "full_bytes": full_bytes,
            "baseline_bytes": baseline,
            "shard_bytes": shard,
            "largest_tensor_bytes": largest,
            "peak_rss_bytes": peak,
            "ratio": peak / (baseline + shard),
            "bound_ratio": peak / (baseline + shard + largest),
            "seconds": seconds,
        }
    )
    dist.barrier()
    dist.destroy_process_group()


def _job(how: str, config: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, how, config, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = sorted((q.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/export_memory.json"))
    args = parser.parse_args(argv)
    config = _config(args.layers, args.hidden, args.vocab)
    rows = [*_job("stream", config), *_job("dict", config)]
    lines = [
        f"Llama, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: "
        f"{rows[0]['full_bytes'] / MIB:.0f} MiB of parameters, tp=2",
        "",
        "| export | rank | baseline (MiB) | shard (MiB) | largest tensor (MiB) | peak RSS (MiB) "
        "| peak / (baseline + shard) | peak / (baseline + shard + largest) | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['how']} | {r['rank']} | {r['baseline_bytes'] / MIB:.0f} | "
            f"{r['shard_bytes'] / MIB:.0f} | {r['largest_tensor_bytes'] / MIB:.1f} | "
            f"{r['peak_rss_bytes'] / MIB:.0f} | {r['ratio']:.3f} | {r['bound_ratio']:.3f} | "
            f"{r['seconds']:.2f} |"
        )
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
