"""Compare a parallelized model with its single-device original, tensor by tensor."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hp_core.runtime.experts import expert_placements
from hp_core.runtime.layouts import to_placements

__all__ = ["allclose_excess", "full_expert_tensor", "full_grads", "full_tensor", "max_abs_diff", "run_excess"]


def full_tensor(t: torch.Tensor, placements_by_axis: dict | None, mesh: Any) -> torch.Tensor:
    """The whole tensor behind a local shard (or a DTensor), on every rank."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    if not placements_by_axis:
        return t
    return DTensor.from_local(t, mesh, to_placements(placements_by_axis, mesh), run_check=False).full_tensor()


def full_grads(model: nn.Module, mesh: Any) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, unsharded, keyed by its (deduplicated) name.

    Expert parameters of expert-parallel boundaries are gathered over their expert mesh
    (stacked per-expert parameters appear under their stacked name).
    """
    state = getattr(model, "_hp_applied", None)
    layouts: dict[int, tuple[dict, Any]] = {}
    if state is not None:
        for fqn, spec in state.plan.items():
            module = model.get_submodule(fqn) if fqn else model
            for rel, named in (spec.params or {}).items():
                path, _, name = rel.rpartition(".")
                owner = module.get_submodule(path) if path else module
                p = owner._parameters.get(name)
                if p is None:
                    continue
                if "ep" in named and spec._ep_size > 1:
                    layouts[id(p)] = (named, state.expert_meshes[spec._ep_size])
                else:
                    layouts[id(p)] = (named, mesh)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            named, on = layouts.get(id(p), (None, mesh))
            if named is not None and on is not mesh:
                out[name] = full_expert_tensor(p.grad, named, on)
            else:
                out[name] = full_tensor(p.grad, named, mesh)
    return out


def full_expert_tensor(t: torch.Tensor, named: dict, expert_mesh: Any) -> torch.Tensor:
    """The whole tensor behind this rank's experts (a local ``[E / ep, ...]`` shard or a DTensor)."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    return DTensor.from_local(t, expert_mesh, expert_placements(named), run_check=False).full_tensor()


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-key max |a - b|; a key in only one of them maps to inf."""
    keys = set(a) | set(b)
    return {k: (float((a[k].float() - b[k].float()).abs().max()) if k in a and k in b else float("inf")) for k in sorted(keys)}


def allclose_excess(a: torch.Tensor, b: torch.Tensor, *, rtol: float = 1e-5) -> float:
    """``max(|a - b| - rtol * |b|)``: at most ``atol`` exactly when ``torch.allclose(a, b, rtol, atol)``."""
    if not a.numel():
        return 0.0
    return float(((a.float() - b.float()).abs() - rtol * b.float().abs()).max())


def run_excess(
    got: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]],
    ref: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]],
    *,
    rtol: float = 1e-5,
) -> dict[str, float]:
    """Excesses of one run's ``(loss, logits, grads)`` over another's, per quantity.

    ``grad`` is the worst over every gradient; two runs whose gradient names differ are an
    error, not a pass.
    """
    (loss_g, logits_g, grads_g), (loss_r, logits_r, grads_r) = got, ref
    if set(grads_g) != set(grads_r):
        raise AssertionError(f"gradient sets differ: {sorted(set(grads_g) ^ set(grads_r))[:8]}")
    return {
        "loss": allclose_excess(loss_g, loss_r, rtol=rtol),
        "logits": allclose_excess(logits_g, logits_r, rtol=rtol),
        "grad": max((allclose_excess(grads_g[n], grads_r[n], rtol=rtol) for n in grads_r), default=0.0),
    }
