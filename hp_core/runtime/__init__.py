"""The applier: ``apply(model, plan, mesh, mode=...)`` (SPEC §5).

Preflight first (no mutation, collective across ranks), then in order: parameters →
boundaries → inner wraps → attributes → gradient hooks → loss. Every mutation goes
through a journal; if any phase fails, the journal is rolled back and the model is
exactly as it was.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn
from torch.distributed.tensor import Shard

from hp_core.injection import InjectionBindingError, check_forward_compatible
from hp_core.planner.comms import sp_grad_params
from hp_core.runtime.boundary import BoundaryForward, InnerOutputCheck
from hp_core.runtime.experts import expert_grad_syncs
from hp_core.runtime.grads import ReplicatedGradSync
from hp_core.runtime.journal import Journal, set_forward
from hp_core.runtime.params import shard_parameters
from hp_core.runtime.preflight import (
    MeshMismatchError,
    PlanMismatchError,
    PreflightError,
    PreflightResult,
    preflight,
)
from hp_core.runtime.vocab import VocabParallelCausalLMLoss, vocab_parallel_embedding
from hp_core.sharding_plan import ShardingPlan

__all__ = [
    "AppliedModel",
    "MeshMismatchError",
    "PlanMismatchError",
    "PreflightError",
    "apply",
    "finalize_grads",
]


@dataclasses.dataclass
class AppliedModel:
    """What ``apply`` left on the model (``model._hp_applied``), for introspection."""

    plan: ShardingPlan
    mode: str
    mesh: Any
    forwards: dict[str, BoundaryForward]
    grad_sync: ReplicatedGradSync | None
    #: ep size → the derived ``(edp, ep)`` expert mesh its experts live on.
    expert_meshes: dict[int, Any] = dataclasses.field(default_factory=dict)
    #: Sums of expert gradients over replicas that saw different tokens (one per ep size).
    expert_grad_syncs: list[ReplicatedGradSync] = dataclasses.field(default_factory=list)


def _tp_group(mesh: Any) -> Any:
    return mesh.get_group("tp") if "tp" in (mesh.mesh_dim_names or ()) else None


def _compute_for(fqn: str, module: nn.Module, plan: ShardingPlan, mesh: Any, mode: str, pre: PreflightResult) -> tuple[Any, bool]:
    """The region's compute and whether validate dispatches DTensors through it."""
    spec = plan[fqn]
    inj = pre.injections.get(fqn)
    if inj is not None and inj.compute_fn is not None:
        fn = inj.compute_fn
        return (lambda *a, **k: fn(module, *a, **k)), spec.region_dispatch is True
    if mode == "production" and isinstance(module, nn.Embedding):
        tp = (spec.params or {}).get("weight", {}).get("tp")
        if isinstance(tp, Shard) and tp.dim == 0 and _tp_group(mesh) is not None:
            return vocab_parallel_embedding(module, _tp_group(mesh)), False
    if inj is not None and inj.inner_wrapper is not None and inj.inner_target == "self":
        return None, spec.region_dispatch is True  # the inner wrap supplies the compute
    return None, spec.region_dispatch is not False


def _inner_wrap(fqn: str, module: nn.Module, plan: ShardingPlan, mesh: Any, mode: str, pre: PreflightResult, journal: Journal) -> Any:
    """Install an inner wrapper's replacement forward; returns it for a ``self`` target."""
    inj = pre.injections.get(fqn)
    if inj is None or inj.inner_wrapper is None:
        return None
    spec = plan[fqn]
    target = module if inj.inner_target == "self" else getattr(module, str(inj.inner_target))
    before = target.__dict__.get("forward")
    original = target.forward
    source = f"plan[{fqn!r}].inner_wrapper"
    # The target's FQN, for the wrapper's error messages (it only receives the module).
    journal.set_attr(target, "_hp_fqn", fqn if inj.inner_target == "self" else f"{fqn}.{inj.inner_target}")
    replacement = inj.inner_wrapper.bind({**pre.meshes, "target_module": target}, source=source)
    if replacement is None:  # the wrapper installed it in place
        replacement = target.__dict__.get("forward")
        if replacement is None or replacement is before:
            raise InjectionBindingError(
                f"{source}: {inj.inner_wrapper.name!r} returned None but did not replace "
                f"{type(target).__name__}.forward; return the replacement forward instead."
            )
        # Undo the wrapper's own assignment if a later phase fails.
        journal.record(lambda: target.__dict__.pop("forward", None) if before is None else target.__dict__.__setitem__("forward", before))
    check_forward_compatible(replacement, original, source=source)
    journal.set_attr(spec, "_resolved_inner_wrapper", inj.inner_wrapper.name)
    journal.set_attr(spec, "_resolved_inner_target", fqn if inj.inner_target == "self" else f"{fqn}.{inj.inner_target}")
    if inj.inner_target == "self":
        return replacement
    if mode == "validate" and spec.region_dispatch is True:
        replacement = InnerOutputCheck(f"{fqn}.{inj.inner_target}", replacement, spec.inner_out_src, mesh)
    set_forward(journal, target, replacement)
    return None


def apply(model: nn.Module, plan: ShardingPlan, mesh: Any, *, mode: str = "production") -> nn.Module:
    """Parallelize ``model`` in place by ``plan`` on ``mesh``; returns the model.

    ``mode="production"``: parameters become local shards for good and single-axis
    transitions run as explicit collectives. ``mode="validate"``: parameters stay
    DTensors and every boundary checks that DTensor propagation produces the declared
    layouts. Both give the same outputs and gradients.
    """
    pre = preflight(model, plan, mesh, mode)
    journal = Journal()
    try:
        shard_parameters(model, plan, mesh, mode, journal, experts=pre.experts)
        forwards: dict[str, BoundaryForward] = {}
        for fqn, spec in plan.items():
            if not spec.is_boundary:
                continue
            module = model.get_submodule(fqn) if fqn else model
            replacement = _inner_wrap(fqn, module, plan, mesh, mode, pre, journal)
            compute, dispatch = _compute_for(fqn, module, plan, mesh, mode, pre)
            bf = BoundaryForward(fqn, module, spec, mesh, mode, compute=compute or replacement, dispatch=dispatch)
            set_forward(journal, module, bf)
            forwards[fqn] = bf
        if mode == "production":
            for fqn, spec in plan.items():
                module = model.get_submodule(fqn) if fqn else model
                for attr, (_glob, local) in (spec._tp_local_attr_plan or {}).items():
                    journal.set_attr(module, attr, local)
        sync = _grad_sync(model, plan, mesh)
        expert_syncs = expert_grad_syncs(model, plan, pre.experts)
        for s in (sync, *expert_syncs):
            if s is not None:
                handle = model.register_forward_pre_hook(lambda _m, _a, s=s: s.arm())
                journal.record(handle.remove)
                journal.record(s.remove)
        if plan.loss_parallel:
            _install_loss(model, mesh, journal)
        meshes = {ep: groups.mesh for ep, groups in pre.experts.items()}
        state = AppliedModel(plan, mode, mesh, forwards, sync, meshes, expert_syncs)
        journal.set_attr(model, "_hp_applied", state)
    except BaseException:
        journal.rollback()
        raise
    return model


def _grad_sync(model: nn.Module, plan: ShardingPlan, mesh: Any) -> ReplicatedGradSync | None:
    group = _tp_group(mesh)
    if group is None or mesh["tp"].size() == 1:
        return None
    # A list in plan order: every rank must concatenate the gradients in the same order.
    names = list(sp_grad_params(plan.modules))
    if not names:
        return None
    params = []
    seen: set[int] = set()
    for name in names:
        path, _, attr = name.rpartition(".")
        p = (model.get_submodule(path) if path else model)._parameters.get(attr)
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return ReplicatedGradSync(params, group)


def _install_loss(model: nn.Module, mesh: Any, journal: Journal) -> None:
    group = _tp_group(mesh)
    if group is None:
        return
    had = "_loss_function" in model.__dict__
    old = model.__dict__.get("_loss_function")
    model.loss_function = VocabParallelCausalLMLoss(group)

    def undo() -> None:
        if had:
            model.__dict__["_loss_function"] = old
        else:
            model.__dict__.pop("_loss_function", None)

    journal.record(undo)


def finalize_grads(model: nn.Module) -> None:
    """Run the pending gradient reductions now: the tp sum of sequence-parallel replicated
    gradients and the sum of expert gradients over their replicas.

    hp runs each automatically when the last of its gradients arrives; call this only if
    some of those parameters got no gradient in a backward (e.g. a skipped layer).
    """
    state = getattr(model, "_hp_applied", None)
    if state is not None:
        for sync in (state.grad_sync, *state.expert_grad_syncs):
            if sync is not None:
                sync.flush()

