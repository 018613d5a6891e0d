"""Train a tiny Hugging Face Llama with tensor + sequence parallelism, and check every step.

    python examples/tp_train.py                 # spawns 2 CPU ranks itself
    torchrun --nproc-per-node 2 examples/tp_train.py

Each rank plans the model for its mesh, applies the plan in production mode, and trains
a few AdamW steps; rank 0 also trains an unsharded copy and prints both losses per step.
The script exits non-zero if any step differs by more than the tolerance.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import hp_core
from hp_core.presets import build_model


def train(rank: int, world: int, args: argparse.Namespace) -> bool:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = build_model(args.model, seed=0)
    reference = copy.deepcopy(model)
    plan = hp_core.plan(model, mesh, sequence_parallel=not args.no_sp)
    if rank == 0:
        print(plan.explain() if args.explain else f"planned {len(plan)} modules for tp={world}")
    hp_core.apply(model, plan, mesh, mode="production")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    ok = True
    if rank == 0:
        print(f"{'step':>4}  {'sharded':>10}  {'single':>10}  {'|diff|':>9}")
    for step in range(args.steps):
        ids = torch.randint(
            0, 128, (args.batch, args.seq), generator=torch.Generator().manual_seed(step)
        )
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            o.step()
            if m is model:
                sharded = float(loss.detach())
            else:
                single = float(loss.detach())
        diff = abs(sharded - single)
        ok &= diff <= 1e-5 + 1e-5 * abs(single)
        if rank == 0:
            print(f"{step:>4}  {sharded:>10.6f}  {single:>10.6f}  {diff:>9.2e}")
    return ok


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace, results: object) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        results.put((rank, train(rank, world, args)))  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama", choices=["llama", "qwen2", "mistral"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument(
        "--no-sp", action="store_true", help="plain tensor parallelism, no sequence parallelism"
    )
    parser.add_argument(
        "--explain", action="store_true", help="print the plan with its collectives"
    )
    args = parser.parse_args(argv)
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
        ok = train(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
        return 0 if ok else 1
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_spawned, args=(r, args.world, port, args, results))
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        print("a rank failed; see its traceback above", file=sys.stderr)
        return 1
    verdicts = dict(results.get() for _ in procs)
    ok = all(verdicts.values())
    print("every step matches the single-device run" if ok else "MISMATCH: see the table above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
