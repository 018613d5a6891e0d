"""Export a tensor-parallel model for Hugging Face: ``save_pretrained`` / ``from_pretrained``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/export_hf.py

Two ranks apply a tiny Llama at tp=2 (production mode: each rank holds its shards as plain
tensors). ``hp_core.full_state_dict`` gathers the full state dict, one tensor at a time,
under the model's own parameter names; rank 0 gets it (the other ranks get ``{}``) and
writes it with ``save_pretrained(dir, state_dict=...)``. Then rank 0 loads the directory
with ``AutoModelForCausalLM.from_pretrained`` in its own process, with no parallelism: its
logits equal the sharded model's and the single-device model's. See docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

import hp_core
from hp_core.testing.families import build_family, family_batch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="output directory (default: a temp dir)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))

    single = build_family("llama", seed=0)  # the same weights on every rank
    model = copy.deepcopy(single)
    hp_core.apply(model, hp_core.plan(model, mesh), mesh)
    batch = family_batch("llama", batch=2, seq=16)
    with torch.no_grad():
        sharded_logits = model(input_ids=batch, use_cache=False).logits
        single_logits = single(input_ids=batch, use_cache=False).logits

    state = hp_core.full_state_dict(model)  # every rank calls it; rank 0 gets the tensors
    ok = True
    if rank == 0:
        path = args.dir or tempfile.mkdtemp(prefix="hp-export-")
        model.save_pretrained(path, state_dict=state)
        loaded = AutoModelForCausalLM.from_pretrained(path)  # one process, no parallelism
        with torch.no_grad():
            logits = loaded(input_ids=batch, use_cache=False).logits
        vs_sharded = float((logits - sharded_logits).abs().max())
        vs_single = float((logits - single_logits).abs().max())
        ok = vs_sharded <= 1e-5 and vs_single <= 1e-5
        print(f"exported {len(state)} tensors to {path}")
        print(f"from_pretrained vs the tp=2 model: max logit difference {vs_sharded:.2e}")
        print(f"from_pretrained vs one device: max logit difference {vs_single:.2e}")
        print("the exported model matches" if ok else "MISMATCH")
    else:
        ok = state == {}
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
