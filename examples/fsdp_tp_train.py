"""Tensor + sequence parallelism by hp inside, FSDP2 on the data-parallel axis outside.

    torchrun --nproc-per-node 4 examples/fsdp_tp_train.py            # dp=2 x tp=2 on CPU
    torchrun --nproc-per-node 4 examples/fsdp_tp_train.py --ddp      # DDP instead of FSDP2

The order of calls is the recipe (docs/training.md):

1. one DeviceMesh with the dp axis outermost: ``init_device_mesh(device, (dp, tp), ("dp", "tp"))``;
2. ``hp_core.plan(model, mesh)`` then ``hp_core.apply(model, plan, mesh)`` — hp shards over tp
   and leaves dp alone;
3. ``fully_shard(layer, mesh=mesh["dp"])`` for every decoder layer, then for the root (or
   ``DistributedDataParallel(model, process_group=mesh["dp"].get_group())``);
4. the optimizer over ``model.parameters()`` *after* wrapping;
5. per step: forward, backward (hp sums its partial gradients after FSDP/DDP reduced
   theirs), ``hp_core.clip_grad_norm_(model, max_norm)``, ``optimizer.step()``.

Each dp replica trains on its own batch. With ``--check`` every rank also trains an
unsharded copy on all replicas' batches and the script fails if any step's loss or
gradient norm differs from it by more than 1e-5.
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
from hp_core.testing.compare import nan_safe_max
from hp_core.testing.families import build_family, family_batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-norm", type=float, default=0.5)
    parser.add_argument("--no-sp", action="store_true", help="plain tensor parallelism")
    parser.add_argument("--ddp", action="store_true", help="DDP on dp instead of FSDP2")
    parser.add_argument("--check", action="store_true", help="compare every step with one device")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        print(
            "launch with torchrun, e.g.: torchrun --nproc-per-node 4 examples/fsdp_tp_train.py",
            file=sys.stderr,
        )
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        return 0 if train(args, device) else 1
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, device: str) -> bool:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = build_family(args.model, seed=0, device=device)
    reference = copy.deepcopy(model) if args.check else None

    plan = hp_core.plan(model, mesh, sequence_parallel=not args.no_sp)
    hp_core.apply(model, plan, mesh)  # verifies the plan first, then shards over tp
    if args.ddp:
        from torch.nn.parallel import DistributedDataParallel

        wrapped: torch.nn.Module = DistributedDataParallel(
            model, process_group=mesh["dp"].get_group()
        )
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        wrapped = fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = (
        torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
        if reference is not None
        else None
    )

    dp, n_dp = mesh.get_local_rank("dp"), mesh["dp"].size()
    ok = True
    if rank == 0:
        print(
            f"{'step':>4}  {'loss':>10}  {'grad norm':>10}"
            + (f"  {'single':>10}  {'|diff|':>9}" if reference else "")
        )
    for step in range(args.steps):
        batches = [family_batch(args.model, seed=1000 * step + r).to(device) for r in range(n_dp)]
        opt.zero_grad(set_to_none=True)
        loss = wrapped(input_ids=batches[dp], labels=batches[dp], use_cache=False).loss
        loss.backward()
        norm = hp_core.clip_grad_norm_(model, args.max_norm)
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())
        mean /= n_dp
        line = f"{step:>4}  {float(mean):>10.6f}  {float(norm):>10.6f}"
        if reference is not None and ref_opt is not None:
            ref_opt.zero_grad(set_to_none=True)
            ref_loss = (
                sum(reference(input_ids=b, labels=b, use_cache=False).loss for b in batches) / n_dp
            )
            ref_loss.backward()
            ref_loss = ref_loss.detach()
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), args.max_norm)
            ref_opt.step()
            # nan_safe_max: a NaN loss or norm is an infinite difference (max(0.0, nan) is 0.0)
            diff = nan_safe_max(
                [abs(float(mean) - float(ref_loss)), abs(float(norm) - float(ref_norm))]
            )
            ok &= diff <= 1e-5 * (1 + abs(float(ref_loss)))
            line += f"  {float(ref_loss):>10.6f}  {diff:>9.2e}"
        if rank == 0:
            print(line)
    if rank == 0 and reference is not None:
        print(
            "every step matches the single-device run"
            if ok
            else "MISMATCH against the single-device run"
        )
    return ok


if __name__ == "__main__":
    sys.exit(main())
