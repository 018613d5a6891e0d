"""Checkpoint loading: peak RSS and time of ``load_pretrained`` against a full load.

A Llama checkpoint (default 1.1 B parameters in bf16: hidden 2048, ffn 5632, 22 layers,
32 heads, 4 kv heads, vocab 32000; a 2.2 GB file set) is written once with safetensors
(random values, ~500 MB shards and an index, as ``save_pretrained`` lays them out). Then,
at tp=2 and tp=4 (gloo, one fresh process per rank and job), each rank reports:

* (a) meta-build + plan + apply + ``hp_core.load_pretrained``: its peak RSS, against its
  shard bytes (the replicated parameters plus its slice of every sharded one) plus the
  process's baseline (RSS after imports and the process group, before the model);
* (b) ``from_pretrained`` (the full model on every rank) + plan + apply: the same;
* the time of (a)'s load, against reading the very same slices with safetensors directly
  (one ``safe_open`` per file, ``get_slice(key)[index]`` copied) in the same process.
  The files are read once beforehand, so both find them in the page cache.

With ``--fsdp``, two more jobs at dp=2 x tp=2 (four ranks, FSDP2 per decoder layer and
on the root over ``mesh["dp"]``): ``fsdp_first`` (apply → ``fully_shard`` on meta →
``load_pretrained``: each rank reads FSDP's piece only) and ``fsdp_after`` (apply →
``load_pretrained`` → ``fully_shard``: each rank holds hp's whole tp shard first). Their
shard is what FSDP keeps on the rank.

    python benchmarks/checkpoint_load.py [--tiny] [--tp 2 4] [--fsdp] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

FULL = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=256,
)
MIB = 2**20
FSDP_JOBS = ("fsdp_first", "fsdp_after")
JOBS = {
    "meta": "meta + apply + load_pretrained",
    "full": "from_pretrained + apply",
    "fsdp_first": "meta + apply + fully_shard + load_pretrained",
    "fsdp_after": "meta + apply + load_pretrained + fully_shard",
}


def _config(values: dict[str, int]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**values, dtype="bfloat16")


def write_checkpoint(path: Path, values: dict[str, int], shard_bytes: int = 500 * MIB) -> int:
    """A sharded safetensors checkpoint of random bf16 values; returns its parameter count."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    cfg = _config(values)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    groups: list[list[str]] = [[]]  # keys per shard file, ~shard_bytes each
    size = 0
    for key, shape in shapes.items():
        if size + shape.numel() * 2 > shard_bytes and groups[-1]:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += shape.numel() * 2
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, keys in enumerate(groups):  # one shard in memory at a time
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {k: (torch.randn(shapes[k], generator=gen) * 0.02).to(torch.bfloat16) for k in keys}
        save_file(shard, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
        del shard
    total = sum(shapes[k].numel() * 2 for k in weight_map)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg.save_pretrained(path)
    return sum(s.numel() for s in shapes.values())


def _warm(root: Path) -> None:
    """Read every file once, so every job (and the direct read) finds it in the page cache."""
    for file in sorted(root.glob("*.safetensors")):
        with file.open("rb") as f:
            while f.read(64 * MIB):
                pass


def _rss() -> int:
    """Resident set size now (Linux: /proc/self/statm counts pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    """Peak RSS of this process image (VmHWM). ``ru_maxrss`` would not do: Linux keeps it
    across fork and exec, so a spawned rank would report its parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _direct_read(requests: list[tuple[str, str, tuple[slice, ...]]]) -> float:
    """Seconds to read the same slices with safetensors alone (one safe_open per file)."""
    from safetensors import safe_open

    start = time.perf_counter()
    by_file: dict[str, list[tuple[str, tuple[slice, ...]]]] = {}
    for file, key, index in requests:
        by_file.setdefault(file, []).append((key, index))
    for file, items in by_file.items():
        with safe_open(file, "pt") as f:
            for key, index in items:
                view = f.get_slice(key)[index] if index else f.get_tensor(key)
                view.clone()
    return time.perf_counter() - start


def _rank(rank: int, world: int, port: int, path: str, how: str, values: dict, q: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    import hp_core
    from hp_core.checkpoint import safetensors_files

    fsdp = how.startswith("fsdp")
    if fsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))

    def shard(model: Any) -> None:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])

    dist.barrier()
    baseline = _rss()
    requests: list[tuple[str, str, tuple[slice, ...]]] = []
    start = time.perf_counter()
    if how == "meta" or fsdp:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_config(values), dtype=torch.bfloat16)
        hp_core.apply(model, hp_core.plan(model, mesh), mesh, mode="production")
        if how == "fsdp_first":
            shard(model)
        orig = safetensors_files.read_slice

        def spy(entry: Any, index: tuple[slice, ...]) -> torch.Tensor:
            requests.append((str(entry.file), entry.key, index))
            return orig(entry, index)

        safetensors_files.read_slice = spy
        t0 = time.perf_counter()
        hp_core.load_pretrained(model, path)
        load_s = time.perf_counter() - t0
        safetensors_files.read_slice = orig
        if how == "fsdp_after":
            shard(model)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        hp_core.apply(model, hp_core.plan(model, mesh), mesh, mode="production")
        load_s = float("nan")
    total_s = time.perf_counter() - start
    peak = _peak()
    held = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
        for p in model.parameters()
    )
    held += sum(b.numel() * b.element_size() for b in model.buffers())
    direct_s = _direct_read(requests) if requests else float("nan")
    q.put(
        {
            "rank": rank,
            "tp": world,
            "how": how,
            "baseline_bytes": baseline,
            "peak_rss_bytes": peak,
            "shard_bytes": held,
            "ratio": peak / (held + baseline),
            "total_s": total_s,
            "load_s": load_s,
            "direct_read_s": direct_s,
            "load_over_direct": load_s / direct_s if requests else float("nan"),
        }
    )
    dist.destroy_process_group()


def _job(world: int, path: str, how: str, values: dict) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    args = (world, port, path, how, values, q)
    procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    out: list[dict[str, Any]] = []
    while len(out) < world:
        try:
            out.append(q.get(timeout=5))
        except queue.Empty:
            dead = {i: p.exitcode for i, p in enumerate(procs) if p.exitcode not in (None, 0)}
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"tp={world} {how}: rank(s) died: {dead}") from None
    for p in procs:
        p.join()
    return sorted(out, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", type=Path, default=Path("benchmarks/results/checkpoint_load.json")
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama (for the tests)")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint")
    parser.add_argument(
        "--fsdp", action="store_true", help="also dp=2 x tp=2 under FSDP2, loaded before/after"
    )
    args = parser.parse_args(argv)
    values = TINY if args.tiny else FULL
    root = Path(tempfile.mkdtemp(prefix="hp_ckpt_", dir=args.dir))
    try:
        t0 = time.perf_counter()
        params = write_checkpoint(root, values)
        write_s = time.perf_counter() - t0
        _warm(root)
        rows = [
            r
            for tp in args.tp
            for how in ("meta", "full")
            for r in _job(tp, str(root), how, values)
        ]
        if args.fsdp:
            rows += [r for how in FSDP_JOBS for r in _job(4, str(root), how, values)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lines = [
        f"Llama {params / 1e9:.2f} B parameters, bf16 ({values}); checkpoint written in "
        f"{write_s:.0f} s",
        "",
        "| tp | rank | job | baseline (MiB) | shard (MiB) | peak RSS (MiB) | "
        "peak / (shard + baseline) | load (s) | direct read (s) | load / direct |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        job = JOBS[r["how"]]
        tp = f"2 x {r['tp'] // 2} (dp x tp)" if r["how"] in FSDP_JOBS else r["tp"]
        lines.append(
            f"| {tp} | {r['rank']} | {job} | {r['baseline_bytes'] / MIB:.0f} | "
            f"{r['shard_bytes'] / MIB:.0f} | {r['peak_rss_bytes'] / MIB:.0f} | "
            f"{r['ratio']:.2f} | {r['total_s'] if r['how'] == 'full' else r['load_s']:.1f} | "
            f"{r['direct_read_s']:.1f} | {r['load_over_direct']:.2f} |"
        )
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"params": params, "config": values, "rows": rows}, indent=2) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
