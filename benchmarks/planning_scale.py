"""Planning scale: hp's plan + preflight checks vs parallelize_module, 7B-shaped Llama, tp=8.

Both sides work on the meta device. hp plans against a mesh that is only names and sizes;
parallelize_module needs a process group, so it gets torch's in-process fake one (world 8).
Times exclude building the model. t(2N)/t(N) near 2 means linear scaling.

    python benchmarks/planning_scale.py [--layers 32 64 128 256 512 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        num_hidden_layers=layers,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def time_hp(layers: int) -> float:
    from hp_core.mesh import MeshSpec
    from hp_core.planner.lints import lint_plan
    from hp_core.planner.plan import plan

    model = _model(layers)
    mesh = MeshSpec(("tp",), (8,))
    t0 = time.perf_counter()
    p = plan(model, mesh)
    lint_plan(model, p.modules, mesh)  # the structural checks apply's preflight repeats
    return time.perf_counter() - t0


def time_torch(layers: int, mesh) -> float:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = _model(layers)
    tp_plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(layers):
        for n in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            tp_plan[f"model.layers.{i}.{n}"] = ColwiseParallel()
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            tp_plan[f"model.layers.{i}.{n}"] = RowwiseParallel()
    t0 = time.perf_counter()
    parallelize_module(model, mesh, tp_plan)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024])
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/planning_scale.json"))
    args = parser.parse_args(argv)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("tp",))
    time_hp(2), time_torch(2, mesh)  # warm-up: imports, registries, sharding caches
    rows = []
    for n in args.layers:
        rows.append({"layers": n, "hp_s": time_hp(n), "torch_s": time_torch(n, mesh)})
    lines = [
        "| layers | hp plan + checks (s) | parallelize_module (s) | hp t(2N)/t(N) | torch "
        "t(2N)/t(N) | hp speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows):
        prev = rows[i - 1] if i else None
        g_hp = f"{r['hp_s'] / prev['hp_s']:.2f}" if prev else "-"
        g_t = f"{r['torch_s'] / prev['torch_s']:.2f}" if prev else "-"
        lines.append(
            f"| {r['layers']} | {r['hp_s']:.3f} | {r['torch_s']:.3f} | {g_hp} | {g_t} | "
            f"{r['torch_s'] / r['hp_s']:.1f}x |"
        )
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
