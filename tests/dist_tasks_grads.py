"""Rank-side tasks: the derived gradient reductions under the ways people call backward."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from hp_core import apply, finalize_grads, plan
from hp_core.testing.compare import gather_full_grads, grads_excess
from hp_core.testing.families import build_family, family_batch


def _setup(family: str = "qwen3") -> tuple[Any, Any, Any]:
    base = build_family(family)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ref, par = copy.deepcopy(base), copy.deepcopy(base)
    apply(par, plan(par, mesh), mesh)
    return ref, par, mesh


def _excess(par: Any, ref: Any, mesh: Any) -> float:
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    return grads_excess(gather_full_grads(par, ref, mesh), ref_grads, rtol=1e-5)


def two_backwards_through_one_forward() -> dict[str, Any]:
    """Two losses of one forward, each backward with retain_graph: each adds only its share."""
    ref, par, mesh = _setup()
    ids = family_batch("qwen3")
    for m in (ref, par):
        out = m(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward(retain_graph=True)
        out.logits.float().square().mean().backward()
    reducer = par._hp_applied.grad_reducer
    return {
        "excess": _excess(par, ref, mesh),
        "reductions": reducer.reductions,
        "early": reducer.early,
    }


def finalize_is_idempotent() -> dict[str, Any]:
    ref, par, mesh = _setup()
    ids = family_batch("qwen3")
    for m in (ref, par):
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    finalize_grads(par)
    finalize_grads(par)
    return {
        "excess": _excess(par, ref, mesh),
        "reductions": par._hp_applied.grad_reducer.reductions,
    }


def learned_activation_matches() -> dict[str, Any]:
    """The toy with a learned Swish slope inside its MLP, tp=2 production: every gradient
    matches."""
    from tests import _toy_models as toys

    torch.manual_seed(0)
    base = toys.learned_activation_lm()
    with torch.no_grad():
        base.model.layers[0].mlp.beta.fill_(1.3)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ref, par = copy.deepcopy(base), copy.deepcopy(base)
    apply(par, plan(par, mesh), mesh)
    ids = family_batch("llama")
    for m in (ref, par):
        torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten()).backward()
    return {
        "excess": _excess(par, ref, mesh),
        "beta_grad": float(ref.model.layers[0].mlp.beta.grad),
    }
