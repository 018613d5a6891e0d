"""Rank-side tasks: randomness under tensor parallelism (the Megatron RNG rule)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hp_core import apply, plan
from hp_core.testing.compare import max_abs_diff, nan_safe_max
from hp_core.testing.families import build_family, family_batch
from tests import _toy_models as toys

DROPOUT = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attention_dropout": 0.1}


def _mesh() -> Any:
    return init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def replicated_outputs_agree(sp: bool, mode: str, streams: bool = True) -> dict[str, Any]:
    """Phi with every dropout on, ranks seeded differently: each tp-replicated output is
    bit-identical.

    ``streams=False`` switches hp's random streams off (the negative control)."""
    m = build_family("phi", **DROPOUT)
    mesh = _mesh()
    p = plan(m, mesh, sequence_parallel=sp)
    apply(m, p, mesh, mode=mode)
    m.train()
    if not streams:
        m._hp_applied.rng.active = False
        for bf in m._hp_applied.forwards.values():
            bf.rng = None
    seen: list[tuple[str, torch.Tensor]] = []
    for fqn, spec in p.items():
        layouts = list((spec.out_dst or {}).values())
        if spec.is_boundary and layouts and not hasattr(layouts[0].get("tp"), "dim"):
            module = m.get_submodule(fqn) if fqn else m
            module.register_forward_hook(
                lambda _m, _a, out, fqn=fqn: seen.append(
                    (fqn, (out[0] if isinstance(out, tuple) else out).detach())
                )
            )
    torch.manual_seed(1000 + dist.get_rank())  # the user's own seeding differs per rank
    ids = family_batch("phi")
    out = m(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    differ = [fqn for fqn, t in seen if any(not torch.equal(t, o) for o in _gathered(t))]
    logits = _gathered(out.logits.detach())
    return {
        "checked": len(seen),
        "differ": differ,
        "logits_equal": all(torch.equal(logits[0], x) for x in logits),
    }


def sharded_draws_differ() -> dict[str, Any]:
    """A draw inside a tp-sharded region differs per rank; one in the model's own code does not."""
    torch.manual_seed(0)
    m = toys.drawing_lm()
    outside: list[torch.Tensor] = []
    mesh = _mesh()
    apply(m, plan(m, mesh, sequence_parallel=False), mesh)
    m.train()
    m.model.register_forward_pre_hook(lambda *_: outside.append(torch.rand(4)))
    torch.manual_seed(7 + dist.get_rank())  # the user's own seeding differs per rank
    m(family_batch("llama"))
    after = torch.rand(4)
    torch.manual_seed(7 + dist.get_rank())
    untouched = torch.rand(4)
    ins, outs = _gathered(m.model.layers[0].self_attn.draws[0]), _gathered(outside[0])
    return {
        "inside_differ": not torch.equal(ins[0], ins[1]),
        "outside_equal": torch.equal(outs[0], outs[1]),
        "user_stream_restored": torch.equal(after, untouched),
    }


def checkpointing_replays_the_draws(mode: str) -> dict[str, Any]:
    """With dropout on, activation checkpointing gives the gradients of the run without it."""
    base = build_family("phi", **DROPOUT)
    mesh = _mesh()
    runs = []
    for ckpt in (False, True):
        m = copy.deepcopy(base)
        torch.manual_seed(3)  # the base seed the tp ranks agree on comes from the seed at apply
        apply(m, plan(m, mesh), mesh, mode=mode)
        m.train()
        if ckpt:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(3)
        ids = family_batch("phi")
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        runs.append(
            {
                n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
                for n, p in m.named_parameters()
                if p.grad is not None
            }
        )
    # NaN-safe: a NaN/inf, or a gradient present in only one run, is an infinite difference
    worst = nan_safe_max(max_abs_diff(runs[0], runs[1]).values())
    return {"worst": worst, "n": len(runs[0])}
