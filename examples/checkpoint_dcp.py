"""Save a tensor-parallel model with torch.distributed.checkpoint, resume it, reshard it.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/checkpoint_dcp.py

Two ranks train a tiny Llama on tp=2 (production mode) for two AdamW steps and save the
model with ``dcp.save``. A fresh model (different weights) is planned, applied and loaded
from the checkpoint: its logits equal the saved model's. Then rank 0 alone loads the same
checkpoint into an ordinary, unsharded model in one process: tp=2 resharded to one device.
The state dict of an hp model carries each parameter's layout (DTensor views over the
local shards), which is what lets DCP do this; see docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

import hp_core
from hp_core.testing.families import build_family, family_batch


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
    batch = family_batch("llama", batch=2, seq=16)
    for _ in range(2):
        model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    dcp.save(model.state_dict(), checkpoint_id=path[0])

    resumed = build_family("llama", seed=1)  # other weights until the checkpoint loads
    hp_core.apply(resumed, hp_core.plan(resumed, mesh), mesh)
    state = resumed.state_dict()
    dcp.load(state, checkpoint_id=path[0])
    resumed.load_state_dict(state)
    with torch.no_grad():
        want = model(input_ids=batch, use_cache=False).logits
        got = resumed(input_ids=batch, use_cache=False).logits
    resumed_diff = float((want - got).abs().max())
    dist.barrier()

    ok = resumed_diff <= 1e-6
    if rank == 0:
        whole = build_family("llama", seed=2)  # one process, no process group
        whole_state = whole.state_dict()
        dcp.load(whole_state, checkpoint_id=path[0], no_dist=True)
        whole.load_state_dict(whole_state)
        with torch.no_grad():
            single_diff = float((whole(input_ids=batch, use_cache=False).logits - want).abs().max())
        ok = ok and single_diff <= 1e-5
        print(f"resumed on tp=2: max logit difference {resumed_diff:.2e}")
        print(f"resharded to one process: max logit difference {single_diff:.2e}")
        print("the checkpoint restores the model" if ok else "MISMATCH")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
