"""The verifier's three runs of the model on meta-device copies: validate, production, unsharded.

Each installs the plan (or not, for the unsharded copy) on a weightless copy, wraps every
boundary with its probe (``hp_core.verifier.probes``) and runs one forward — the
production copy also a backward. Repeated layers share one copy and pass their input
through after their first distinct call.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hp_core.errors import HpError
from hp_core.plans.model import ShardingPlan
from hp_core.runtime.install import install
from hp_core.runtime.journal import Journal
from hp_core.runtime.partial import is_expert_param
from hp_core.runtime.preflight import InjectionPlan, PreflightResult
from hp_core.spec.module_spec import layout_map
from hp_core.verifier.errors import ProductionDiffersError
from hp_core.verifier.meta import adapt_for_meta, meta_clone
from hp_core.verifier.probes import (
    BoundaryRecord,
    ProductionProbe,
    Repeater,
    ShapeRecorder,
    ValidateProbe,
    opaque_fallback,
    tensors_in,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "map_to_rep",
    "plain_pass",
    "prefixes",
    "production_pass",
    "reduced_plan",
    "under",
    "validate_pass",
    "verifier_pre",
]


def verifier_pre(pre: PreflightResult, plan: ShardingPlan) -> PreflightResult:
    """Injections for the meta copies: pure-op ones stay, others yield to the module's forward."""
    injections = {}
    for fqn, inj in pre.injections.items():
        keep = plan[fqn].region_dispatch is True
        injections[fqn] = inj if keep else InjectionPlan()
    return PreflightResult(injections, pre.context)


def prefixes(fqn: str) -> list[str]:
    """``"a.b.c"`` → ``["a", "a.b", "a.b.c"]``."""
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def under(fqn: str, roots: Mapping[str, Any]) -> str | None:
    """The root of ``roots`` that ``fqn`` is (or lies under), if any (a dict lookup per prefix)."""
    return next((p for p in prefixes(fqn) if p in roots), None)


def map_to_rep(fqn: str, repeats: Mapping[str, str]) -> str:
    root = under(fqn, repeats)
    return fqn if root is None else repeats[root] + fqn[len(root) :]


def reduced_plan(plan: ShardingPlan, repeats: Mapping[str, str]) -> ShardingPlan:
    modules = {f: copy.copy(s) for f, s in plan.items() if under(f, repeats) is None}
    return dataclasses.replace(plan, modules=modules, notes=[])


def _run(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], backward: bool) -> None:
    out = model(*args, **kwargs)
    if not backward:
        return
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
        return
    outs = [t for t in tensors_in(out) if t.requires_grad and t.is_floating_point()]
    if outs:
        torch.autograd.backward(outs, [torch.zeros_like(t) for t in outs])


def _region_params(model: nn.Module, plan: ShardingPlan, fqn: str) -> dict[str, Any]:
    """Parameters a boundary's region uses: its own and those of non-boundary specs inside it."""
    boundaries = [
        f
        for f, s in plan.items()
        if s.is_boundary and f != fqn and (not fqn or f.startswith(fqn + "."))
    ]
    out: dict[str, Any] = {}
    for f, spec in plan.items():
        inside = f == fqn or not fqn or f.startswith(fqn + ".")
        if (
            not inside
            or (f != fqn and spec.is_boundary)
            or any(f == b or f.startswith(b + ".") for b in boundaries)
        ):
            continue
        for rel, named in layout_map(spec.params).items():
            if is_expert_param(spec, named):
                continue
            name = f"{f}.{rel}" if f else rel
            path, _, attr = name.rpartition(".")
            owner = model.get_submodule(path) if path else model
            p = owner._parameters.get(attr)
            if p is not None:
                out[name] = p
    return out


def _install_copy(
    model: nn.Module,
    plan: ShardingPlan,
    mesh: DeviceMesh,
    mode: str,
    pre: PreflightResult,
    repeats: Mapping[str, str],
) -> tuple[nn.Module, ShardingPlan, Any]:
    clone = meta_clone(model, repeats)
    adapt_for_meta(clone)
    reduced = reduced_plan(plan, repeats)
    state = install(
        clone, reduced, mesh, mode, pre, Journal(), reduce=False, check_inputs=False, streams=False
    )
    return clone, reduced, state


def _wrap_repeaters(clone: nn.Module, repeats: Mapping[str, str]) -> None:
    for rep in dict.fromkeys(repeats.values()):
        module = clone.get_submodule(rep)
        module.__dict__["forward"] = Repeater(module.forward)


def plain_pass(
    model: nn.Module,
    plan: ShardingPlan,
    repeats: Mapping[str, str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> dict[str, BoundaryRecord]:
    """The unsharded model on meta: the global shape of every boundary's inputs and outputs."""
    clone = meta_clone(model, repeats)
    adapt_for_meta(clone)
    reduced = reduced_plan(plan, repeats)
    records: dict[str, BoundaryRecord] = {}
    for fqn, spec in reduced.items():
        if spec.is_boundary:
            module = clone.get_submodule(fqn) if fqn else clone
            records[fqn] = BoundaryRecord(fqn, False)
            module.__dict__["forward"] = ShapeRecorder(module.forward, records[fqn], spec)
    _wrap_repeaters(clone, repeats)
    _run(clone, args, kwargs, backward=False)
    return records


def validate_pass(
    model, plan, mesh, pre, repeats, args, kwargs, on_arrival=None, plain=None
) -> tuple[dict[str, BoundaryRecord], ShardingPlan]:
    clone, reduced, state = _install_copy(model, plan, mesh, "validate", pre, repeats)
    records: dict[str, BoundaryRecord] = {}
    for fqn, bf in state.forwards.items():
        rec = records[fqn] = BoundaryRecord(fqn, bf.dispatch)
        if not bf.dispatch:
            opaque_fallback(bf, rec, (plain or {}).get(fqn), "validate")
        params = _region_params(clone, reduced, fqn) if bf.dispatch else {}
        bf.module.__dict__["forward"] = ValidateProbe(bf, rec, params, on_arrival)
    _wrap_repeaters(clone, repeats)
    _run(clone, args, kwargs, backward=False)
    return records, reduced


def production_pass(
    model, plan, mesh, pre, repeats, args, kwargs, val_records, plain=None
) -> dict[str, BoundaryRecord]:
    clone, _, state = _install_copy(model, plan, mesh, "production", pre, repeats)
    records: dict[str, BoundaryRecord] = {}
    for fqn, bf in state.forwards.items():
        rec = records[fqn] = BoundaryRecord(fqn, False)
        if not val_records[fqn].dispatching:
            opaque_fallback(bf, rec, (plain or {}).get(fqn), "production")
        bf.module.__dict__["forward"] = ProductionProbe(bf, rec)
    _wrap_repeaters(clone, repeats)
    try:
        _run(clone, args, kwargs, backward=True)
    except HpError:
        raise  # a finding of a probe, or a refusal hp's own code raised
    except Exception as e:
        raise ProductionDiffersError(
            "production mode fails outside every boundary, in the model's own code: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. The layouts between "
            "boundaries are not what that code expects (e.g. a sequence-sharded activation where "
            "it needs the whole sequence)."
        ) from e
    return records
