"""Step overhead: hp vs hand-written Megatron TP vs torch's parallelize_module, tp=2 over gloo.

Forward + backward of a tiny Llama (hidden 256, 4 heads, 2 kv heads, ffn 512, 2 layers,
vocab 1024), measured side by side in one run: each iteration times every variant once,
in turn. The table reports the median of the timed steps after warm-up, the min-max spread,
and each variant's ratio to the hand-written baseline. The plan is tensor parallel
without sequence parallelism, the scheme all four variants implement.

    python benchmarks/step_overhead.py [--steps 30] [--warmup 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SHAPES = ((1, 16), (4, 128))
CONFIG = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    num_hidden_layers=2,
    vocab_size=1024,
)


# ---------------------------------------------------------------- hand-written Megatron TP


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        dist.all_reduce(g)
        return g


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g.chunk(dist.get_world_size(), dim=-1)[dist.get_rank()].contiguous()


def _shard(linear: nn.Linear, dim: int) -> None:
    n, r = dist.get_world_size(), dist.get_rank()
    linear.weight = nn.Parameter(linear.weight.detach().chunk(n, dim=dim)[r].clone())


def megatron(model: nn.Module) -> nn.Module:
    """Megatron-style TP by hand: local shards, f/g conjugate ops, vocab-parallel embedding."""
    n, r = dist.get_world_size(), dist.get_rank()
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _shard(lin, 0)
        for lin in (attn.o_proj, mlp.down_proj):
            _shard(lin, 1)
        for block in (attn, mlp):
            inner = block.forward

            def wrapped(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
                if args:
                    args = (_CopyToTP.apply(args[0]), *args[1:])
                else:
                    kwargs["hidden_states"] = _CopyToTP.apply(kwargs["hidden_states"])
                out = _inner(*args, **kwargs)
                if isinstance(out, tuple):
                    return (_ReduceFromTP.apply(out[0]), *out[1:])
                return _ReduceFromTP.apply(out)

            block.forward = wrapped
    emb = model.model.embed_tokens
    rows = emb.weight.shape[0] // n
    emb.weight = nn.Parameter(emb.weight.detach()[r * rows : (r + 1) * rows].clone())

    def embed(ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < r * rows) | (ids >= (r + 1) * rows)
        out = F.embedding((ids - r * rows).masked_fill(outside, 0), emb.weight)
        return _ReduceFromTP.apply(out.masked_fill(outside.unsqueeze(-1), 0.0))

    emb.forward = embed
    head = model.lm_head
    _shard(head, 0)
    head.forward = lambda x: _GatherLastDim.apply(F.linear(_CopyToTP.apply(x), head.weight))
    return model


# ---------------------------------------------------------------- torch's parallelize_module


def torch_tp(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.model.layers)):
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


# ---------------------------------------------------------------- measurement


def _step(model: nn.Module, ids: torch.Tensor) -> None:
    out = model(input_ids=ids, use_cache=False)
    out.logits.float().square().mean().backward()
    model.zero_grad(set_to_none=True)


def measure(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    import hp_core

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    cfg = LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    variants: dict[str, nn.Module] = {"hand-written Megatron TP": megatron(copy.deepcopy(base))}
    for mode in ("production", "validate"):
        m = copy.deepcopy(base)
        hp_core.apply(m, hp_core.plan(m, mesh, sequence_parallel=False), mesh, mode=mode)
        variants[f"hp {mode}"] = m
    # The hand-written baseline checks no inputs; this is hp with the same semantics.
    m = copy.deepcopy(base)
    hp_core.apply(m, hp_core.plan(m, mesh, sequence_parallel=False), mesh, check_inputs=False)
    variants["hp production, check_inputs=False"] = m
    variants["parallelize_module"] = torch_tp(copy.deepcopy(base), mesh)
    table = {}
    for batch, seq in SHAPES:
        ids = torch.randint(
            0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)
        )
        times: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        for it in range(args.warmup + args.steps):
            # The order rotates so that no variant always runs first after the barrier.
            for name in names[it % len(names) :] + names[: it % len(names)]:
                m = variants[name]
                dist.barrier()
                t0 = time.perf_counter()
                _step(m, ids)
                dt = time.perf_counter() - t0
                if it >= args.warmup:
                    times[name].append(dt)
        base_times = times["hand-written Megatron TP"]
        table[f"{batch}x{seq}"] = {
            k: {
                "median_ms": 1e3 * statistics.median(v),
                "min_ms": 1e3 * min(v),
                "max_ms": 1e3 * max(v),
                # Each iteration times every variant back to back, so the ratio within one
                # iteration cancels the machine's drift; its median is the robust figure.
                "paired_ratio": statistics.median(
                    a / b for a, b in zip(v, base_times, strict=True)
                ),
            }
            for k, v in times.items()
        }
    if rank == 0:
        results.put(table)
    dist.destroy_process_group()


def render(table: dict[str, dict[str, dict[str, float]]]) -> str:
    base = "hand-written Megatron TP"
    lines = [
        "| shape (batch x seq) | variant | median ms | min-max ms | ratio of medians | "
        "median paired ratio |",
        "|---|---|---|---|---|---|",
    ]
    for shape, rows in table.items():
        ref = rows[base]["median_ms"]
        for name, r in rows.items():
            lines.append(
                f"| {shape} | {name} | {r['median_ms']:.2f} | "
                f"{r['min_ms']:.2f}-{r['max_ms']:.2f} | "
                f"{r['median_ms'] / ref:.2f}x | {r['paired_ratio']:.3f}x |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/step_overhead.json"))
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=measure, args=(r, 2, port, args, results)) for r in range(2)]
    for p in procs:
        p.start()
    table = results.get()
    for p in procs:
        p.join()
    print(render(table))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
