"""Compare a parallelized model with its single-device original, tensor by tensor.

Two families of helpers live here:

* excesses (:func:`allclose_excess`, :func:`grads_excess`, :func:`run_excess`,
  :func:`max_abs_diff`): how far one
  tensor is from another. Every one of them is NaN-safe: a NaN or an infinity anywhere, or
  two shapes that differ, is an infinite excess, never a pass.
* gatherers: the whole gradient behind each rank's local shard.
  :func:`gather_full_grads` (``hp_core.testing.gather``, re-exported here) is the
  *independent* one: it never reads hp's plan or any hp runtime table.
  :func:`full_grads` reuses the runtime's own placement tables (a layout bug of the
  runtime is then gathered with the same wrong table); prefer the independent one.

And :func:`snapshot_params` / :func:`weights_changed` / :func:`unmoved_params` /
:func:`assert_weights_changed`, which check that an optimizer step really moved the weights
(to finite values: a weight that became NaN/inf did not "move").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hp_core.runtime.experts import expert_placements
from hp_core.runtime.layouts import to_placements
from hp_core.spec.module_spec import layout_map
from hp_core.testing.gather import (
    DEFAULT_EXPERT_PARAMS,
    REPLICA_TOL,
    GradientCheckError,
    gather_full_grads,
    is_data_axis,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "DEFAULT_EXPERT_PARAMS",
    "REPLICA_TOL",
    "GradientCheckError",
    "allclose_excess",
    "assert_weights_changed",
    "full_expert_tensor",
    "full_grads",
    "full_tensor",
    "gather_full_grads",
    "grads_excess",
    "is_data_axis",
    "max_abs_diff",
    "nan_safe_max",
    "run_excess",
    "snapshot_params",
    "unmoved_params",
    "weights_changed",
]


# ------------------------------------------------------------------ excesses


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all()) if t.is_floating_point() or t.is_complex() else True


def nan_safe_max(values: Iterable[float], *, default: float = 0.0) -> float:
    """``max(values)``, but any NaN or infinity makes it ``inf`` (``max(0.0, nan)`` is 0.0)."""
    worst = None
    for v in values:
        v = float(v)
        if not math.isfinite(v):
            return math.inf
        worst = v if worst is None else max(worst, v)
    return default if worst is None else worst


def allclose_excess(a: torch.Tensor, b: torch.Tensor, *, rtol: float = 1e-5) -> float:
    """``max(|a - b| - rtol * |b|)``: <= ``atol`` exactly when ``torch.allclose(a, b, rtol, atol)``.

    ``inf`` when either tensor holds a NaN or an infinity, or when their shapes differ (a
    shape mismatch never broadcasts). Two empty tensors of one shape give 0.0.
    """
    if tuple(a.shape) != tuple(b.shape) or not _finite(a) or not _finite(b):
        return math.inf
    if not a.numel():
        return 0.0
    return float(((a.float() - b.float()).abs() - rtol * b.float().abs()).max())


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-key max |a - b|; a key in only one of them, a NaN/inf or a shape mismatch maps to inf."""
    return {
        k: allclose_excess(a[k], b[k], rtol=0.0) if k in a and k in b else math.inf
        for k in sorted(set(a) | set(b))
    }


def grads_excess(
    got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], *, rtol: float
) -> float:
    """The worst :func:`allclose_excess` over every gradient of ``ref`` (NaN-safe).

    ``inf`` when ``got`` and ``ref`` name different gradients (a gradient missing on either
    side is never a pass), or when any gradient holds a NaN/inf; 0.0 when both are empty.
    """
    if set(got) != set(ref):
        return math.inf
    return nan_safe_max(allclose_excess(got[n], ref[n], rtol=rtol) for n in ref)


def run_excess(
    got: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]],
    ref: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]],
    *,
    rtol: float = 1e-5,
) -> dict[str, float]:
    """Excesses of one run's ``(loss, logits, grads)`` over another's, per quantity.

    ``grad`` is the worst over every gradient (NaN-safe: any non-finite excess is inf); two
    runs whose gradient names differ are an error, not a pass.
    """
    (loss_g, logits_g, grads_g), (loss_r, logits_r, grads_r) = got, ref
    if set(grads_g) != set(grads_r):
        raise AssertionError(f"gradient sets differ: {sorted(set(grads_g) ^ set(grads_r))[:8]}")
    return {
        "loss": allclose_excess(loss_g, loss_r, rtol=rtol),
        "logits": allclose_excess(logits_g, logits_r, rtol=rtol),
        "grad": nan_safe_max(allclose_excess(grads_g[n], grads_r[n], rtol=rtol) for n in grads_r),
    }


# ------------------------------------------------------------------ table-driven gatherers


def full_tensor(t: torch.Tensor, placements_by_axis: dict | None, mesh: DeviceMesh) -> torch.Tensor:
    """The whole tensor behind a local shard (or a DTensor), on every rank."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    if not placements_by_axis:
        return t
    placements = to_placements(placements_by_axis, mesh)
    return DTensor.from_local(t, mesh, placements, run_check=False).full_tensor()


def full_grads(model: nn.Module, mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, unsharded, keyed by its (deduplicated) name.

    Expert parameters of expert-parallel boundaries are gathered over their expert mesh
    (stacked per-expert parameters appear under their stacked name).

    This reads hp's own placement tables (``model._hp_applied.plan``), so a layout bug of
    the runtime is gathered with the same wrong table; :func:`gather_full_grads` does not.
    """
    state = getattr(model, "_hp_applied", None)
    layouts: dict[int, tuple[dict | None, Any]] = {}
    if state is not None:
        for fqn, spec in state.plan.items():
            module = model.get_submodule(fqn) if fqn else model
            for rel, named in layout_map(spec.params).items():
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
            layout, on = layouts.get(id(p), (None, mesh))
            if layout is not None and on is not mesh:
                out[name] = full_expert_tensor(p.grad, layout, on)
            else:
                out[name] = full_tensor(p.grad, layout, mesh)
    return out


def full_expert_tensor(t: torch.Tensor, named: dict, expert_mesh: DeviceMesh) -> torch.Tensor:
    """The whole tensor behind this rank's experts (a local ``[E / ep, ...]`` shard or DTensor)."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    placements = expert_placements(named)
    return DTensor.from_local(t, expert_mesh, placements, run_check=False).full_tensor()


# ------------------------------------------------------------------ the independent gatherer


# ------------------------------------------------------------------ did the optimizer step?


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def snapshot_params(model: nn.Module, *, only_with_grad: bool = False) -> dict[str, torch.Tensor]:
    """Detached clones of every parameter's local data (a DTensor's local shard), by name.

    ``only_with_grad`` keeps only parameters that have a gradient now (those an optimizer
    step is expected to move): take the snapshot after ``backward``, before ``step``.
    """
    return {
        n: _local(p.detach()).clone()
        for n, p in model.named_parameters()
        if not only_with_grad or p.grad is not None
    }


def weights_changed(before: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, float]:
    """Per parameter of ``before``, max |now - before| of this rank's local data.

    Each rank compares its own shard with its own snapshot (no collective). A parameter
    that is NaN/inf now or was in the snapshot, or whose local shape changed, maps to inf
    (never NaN); one that is gone raises.
    """
    now = dict(model.named_parameters())
    missing = sorted(set(before) - set(now))
    if missing:
        raise KeyError(f"parameters gone since the snapshot: {missing[:8]}")
    out: dict[str, float] = {}
    for n, old in before.items():
        cur = _local(now[n].detach())
        if tuple(cur.shape) != tuple(old.shape) or not _finite(cur) or not _finite(old):
            out[n] = math.inf
        else:
            out[n] = float((cur.double() - old.double()).abs().max()) if cur.numel() else 0.0
    return out


def unmoved_params(
    before: Mapping[str, torch.Tensor], model: nn.Module, *, min_change: float = 0.0
) -> list[str]:
    """The parameters of ``before`` that the optimizer step did not really move, sorted.

    A parameter moved when ``min_change < max |now - before| < inf`` on this rank: one that
    did not change by more than ``min_change``, or that is (or was) NaN/inf, is listed.
    """
    return _unmoved(weights_changed(before, model), min_change)


def _unmoved(changes: Mapping[str, float], min_change: float) -> list[str]:
    return sorted(n for n, d in changes.items() if not min_change < d < math.inf)  # NaN: unmoved


def assert_weights_changed(
    before: Mapping[str, torch.Tensor], model: nn.Module, *, min_change: float = 0.0
) -> dict[str, float]:
    """:func:`weights_changed`, raising ``AssertionError`` unless every parameter moved.

    A parameter moved as :func:`unmoved_params` says (by more than ``min_change``, to a
    finite value); the error lists the ones that did not (an optimizer with ``lr=0``, a
    step on the wrong parameters, a step that made a weight NaN, ...).
    """
    changes = weights_changed(before, model)
    still = _unmoved(changes, min_change)  # what unmoved_params(before, model) lists
    if still:
        raise AssertionError(
            f"{len(still)} of {len(changes)} parameter(s) did not change by more than "
            f"{min_change:g} (to a finite value) in the optimizer step: {still[:8]}"
        )
    return changes
