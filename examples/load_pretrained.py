"""Load a Hugging Face checkpoint onto a meta-built, tensor-parallel model: each rank reads
only its own slices.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/load_pretrained.py

Rank 0 saves a tiny seeded Llama with ``save_pretrained`` (what a downloaded checkpoint
looks like). Then every rank builds the same architecture on the meta device (no memory),
plans and applies it at tp=2 (production mode), and calls ``hp_core.load_pretrained``:
each rank reads its shard of every sharded parameter straight from the safetensors file
and the replicated ones whole; the rotary buffers are recomputed. The logits equal the
single-device model's. See docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig, AutoModelForCausalLM

import hp_core
from hp_core.testing.families import build_family, family_batch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    path = [args.dir or tempfile.mkdtemp(prefix="hp-pretrained-")]
    dist.broadcast_object_list(path, src=0)
    reference = build_family("llama", seed=0)  # the single-device model, on every rank
    if rank == 0:
        reference.save_pretrained(path[0])
    dist.barrier()

    config = AutoConfig.from_pretrained(path[0])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    hp_core.apply(model, hp_core.plan(model, mesh), mesh)  # meta stays meta: only chunked
    hp_core.load_pretrained(model, path[0])

    batch = family_batch("llama", batch=2, seq=16)
    with torch.no_grad():
        got = model(input_ids=batch, labels=batch, use_cache=False)
        want = reference(input_ids=batch, labels=batch, use_cache=False)
    diff = float((got.logits - want.logits).abs().max())
    ok = diff <= 1e-5 and abs(float(got.loss) - float(want.loss)) <= 1e-5
    q = model.get_parameter("model.layers.0.self_attn.q_proj.weight")
    print(
        f"rank {rank}: q_proj shard {tuple(q.shape)} of (64, 64), max logit difference {diff:.2e}"
    )
    dist.barrier()
    if rank == 0:
        print("the sharded load matches the single-device model" if ok else "MISMATCH")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
