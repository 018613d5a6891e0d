"""Save a tensor-parallel model and its optimizer with torch.distributed.checkpoint, resume
training from it, reshard it.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/checkpoint_dcp.py

Two ranks train a tiny Llama on tp=2 (production mode) for two AdamW steps and save the
model and the optimizer with ``dcp.save``, then train two more steps: the uninterrupted
run. A fresh model (different weights) and a fresh AdamW are planned, applied and loaded
from the checkpoint; their next two steps give the uninterrupted run's losses. Then rank 0
alone loads the same checkpoint into an ordinary, unsharded model and AdamW in one process
(tp=2 resharded to one device) and trains the same two steps. The state dicts of an hp
model and of its optimizer carry each parameter's layout (DTensor views over the local
shards), which is what lets DCP do this; see docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

import hp_core
from hp_core.testing.families import build_family, family_batch

BATCHES = [family_batch("llama", batch=2, seq=16, seed=step) for step in range(4)]


def train(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> list[float]:
    losses = []
    for batch in batches:
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def checkpoint(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    """The model's and the optimizer's state dicts (on a fresh optimizer: its zero state)."""
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def resume(model: nn.Module, opt: torch.optim.Optimizer, path: str, **load: bool) -> None:
    state = checkpoint(model, opt)
    dcp.load(state, checkpoint_id=path, **load)  # reads the slices this rank needs
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    path = [args.dir or tempfile.mkdtemp(prefix="hp-dcp-")]
    dist.broadcast_object_list(path, src=0)  # every rank writes its shards to one directory

    model = build_family("llama", seed=0)
    hp_core.apply(model, hp_core.plan(model, mesh), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, BATCHES[:2])
    dcp.save(checkpoint(model, opt), checkpoint_id=path[0])
    want = train(model, opt, BATCHES[2:])  # the run that never stopped

    resumed = build_family("llama", seed=1)  # other weights until the checkpoint loads
    hp_core.apply(resumed, hp_core.plan(resumed, mesh), mesh)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    resume(resumed, resumed_opt, path[0])
    got = train(resumed, resumed_opt, BATCHES[2:])
    resumed_diff = max(abs(a - b) for a, b in zip(want, got, strict=True))
    dist.barrier()

    ok = resumed_diff <= 1e-6
    if rank == 0:
        whole = build_family("llama", seed=2)  # one process, no process group
        whole_opt = torch.optim.AdamW(whole.parameters(), lr=1e-2)
        resume(whole, whole_opt, path[0], no_dist=True)
        single = train(whole, whole_opt, BATCHES[2:])
        single_diff = max(abs(a - b) for a, b in zip(want, single, strict=True))
        ok = ok and single_diff <= 1e-4
        print(f"uninterrupted losses of steps 3-4: {want}")
        print(f"resumed on tp=2: max loss difference {resumed_diff:.2e}")
        print(f"resharded to one process: max loss difference {single_diff:.2e}")
        print("the checkpoint restores the model and the optimizer" if ok else "MISMATCH")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
