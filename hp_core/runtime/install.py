"""Install a checked plan on a model: every mutation ``apply`` makes, journaled.

In order: every collective (the input guard's groups, the random streams' seed, the
sharded parameter copies) → hooks → parameters swapped in → boundaries (with their inner
wraps) → tp-local attributes → derived gradient reductions → loss. After the collectives
nothing communicates, so a failure on one rank leaves no other rank blocked. ``install``
assumes preflight (and the verifier) passed; it is also what the verifier runs on its
meta-device copies, with no gradient reductions and the injected compute replaced by the
module's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.tensor import Shard

from hp_core.injection import InjectionBindingError, check_forward_compatible
from hp_core.planner.local_width import INPUT_WIDTH
from hp_core.plans.fixes import fix_match
from hp_core.plans.model import ShardingPlan
from hp_core.runtime.applied import AppliedModel, InnerWrap
from hp_core.runtime.boundary import BoundaryForward
from hp_core.runtime.dtensor_strategies import register_missing_strategies
from hp_core.runtime.experts import expert_grad_reductions
from hp_core.runtime.fused import set_local_attr
from hp_core.runtime.fused_state import FusedStateDict
from hp_core.runtime.gradient_linear import register_partial_gradient_rules
from hp_core.runtime.grads import GradReducer, GradReduction
from hp_core.runtime.guard import InputGuard
from hp_core.runtime.inner_output import InnerOutputCheck
from hp_core.runtime.journal import Journal, set_forward
from hp_core.runtime.layouts import dense_mesh
from hp_core.runtime.optim_state import watch_optimizers
from hp_core.runtime.outer import OuterWrapperCheck
from hp_core.runtime.param_layout import named_layouts
from hp_core.runtime.params import shard_parameters
from hp_core.runtime.preflight import PreflightResult
from hp_core.runtime.region_call import RegionWrapperCall
from hp_core.runtime.rng import RngStreams
from hp_core.runtime.sequence import SequenceFallback, SequenceSwitch
from hp_core.runtime.state_dict import ShardedStateDict
from hp_core.runtime.vocab import VocabParallelCausalLMLoss, VocabParallelLookup
from hp_core.spec.module_spec import ModuleShardingSpec, layout_map

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["install", "vocab_axis"]


def nested_layouts(plan: ShardingPlan, fqn: str) -> dict[str, Mapping[str, Any]]:
    """The parameters of the parameter-only specs (``is_boundary: false``) in boundary
    ``fqn``'s region, by path from it: its code meets them as it meets its own (those inside
    a nested boundary belong to that one)."""
    inner = [f for f, s in plan.items() if s.is_boundary and f != fqn and _inside(f, fqn)]
    out: dict[str, Mapping[str, Any]] = {}
    for f, spec in plan.items():
        if spec.is_boundary or not _inside(f, fqn) or any(_inside(f, b) for b in inner):
            continue
        for rel, named in layout_map(spec.params).items():
            full = f"{f}.{rel}" if f else rel
            out[full[len(fqn) + 1 :] if fqn else full] = named
    return out


def _inside(f: str, fqn: str) -> bool:
    return f != fqn and (not fqn or f.startswith(fqn + "."))


def _tp_group(mesh: DeviceMesh) -> ProcessGroup | None:
    return mesh.get_group("tp") if "tp" in (mesh.mesh_dim_names or ()) else None


def vocab_axis(module: nn.Module, spec: ModuleShardingSpec, mesh: DeviceMesh) -> str | None:
    """The mesh axis an ``nn.Embedding`` boundary's vocabulary rows are sharded on, if any."""
    if not isinstance(module, nn.Embedding):
        return None
    named = layout_map(spec.params).get("weight") or {}
    for axis, placement in named.items():
        if (
            isinstance(placement, Shard)
            and placement.dim == 0
            and axis in (mesh.mesh_dim_names or ())
        ):
            return str(axis)
    return None


def _compute_for(
    fqn: str,
    module: nn.Module,
    plan: ShardingPlan,
    mesh: DeviceMesh,
    mode: str,
    pre: PreflightResult,
) -> tuple[Any, bool]:
    """The region's compute and whether validate dispatches DTensors through it."""
    spec = plan[fqn]
    inj = pre.injections.get(fqn)
    if inj is not None and inj.compute_fn is not None:
        fn = inj.compute_fn
        return (lambda *a, **k: fn(module, *a, **k)), spec.region_dispatch is True
    if inj is not None and inj.inner_wrapper is not None and inj.inner_target == "self":
        return None, spec.region_dispatch is True  # the inner wrap supplies the compute
    axis = vocab_axis(module, spec, mesh)
    if axis is not None and isinstance(module, nn.Embedding):  # vocab_axis: Embeddings only
        return VocabParallelLookup(
            fqn, module, module.forward, mesh, axis, mode
        ), spec.region_dispatch is not False
    return None, spec.region_dispatch is not False


def _inner_wrap(
    fqn: str,
    module: nn.Module,
    plan: ShardingPlan,
    mesh: DeviceMesh,
    mode: str,
    pre: PreflightResult,
    journal: Journal,
    wraps: dict[str, InnerWrap],
) -> Any:
    """Install an inner wrapper's replacement forward; returns it for a ``self`` target.

    What it installed is recorded in ``wraps`` (for ``AppliedModel.inner_wraps``), never on
    the plan's spec."""
    inj = pre.injections.get(fqn)
    if inj is None or inj.inner_wrapper is None:
        return None
    spec = plan[fqn]
    target = module if inj.inner_target == "self" else getattr(module, str(inj.inner_target))
    before = target.__dict__.get("forward")
    original = target.forward
    source = f"plan[{fqn!r}].inner_wrapper"
    # The target's FQN, for the wrapper's error messages (it only receives the module).
    journal.set_attr(
        target, "_hp_fqn", fqn if inj.inner_target == "self" else f"{fqn}.{inj.inner_target}"
    )
    replacement = inj.inner_wrapper.bind(
        {"target_module": target, "ctx": pre.context}, source=source
    )
    if replacement is None:  # the wrapper installed it in place
        replacement = target.__dict__.get("forward")
        if replacement is None or replacement is before:
            raise InjectionBindingError(
                f"{source}: {inj.inner_wrapper.name!r} returned None but did not replace "
                f"{type(target).__name__}.forward; return the replacement forward instead."
            )
        # Undo the wrapper's own assignment if a later phase fails.
        journal.record(
            lambda: (
                target.__dict__.pop("forward", None)
                if before is None
                else target.__dict__.__setitem__("forward", before)
            )
        )
    check_forward_compatible(replacement, original, source=source)
    if mode == "validate" and spec.region_dispatch is True:  # it receives DTensors: say so
        named = fqn if inj.inner_target == "self" else f"{fqn}.{inj.inner_target}"
        provider = inj.inner_wrapper.provider_description or inj.inner_wrapper.provider
        replacement = RegionWrapperCall(fqn, named, inj.inner_wrapper.name, provider, replacement)
    wraps[fqn] = InnerWrap(
        inj.inner_wrapper.name, fqn if inj.inner_target == "self" else f"{fqn}.{inj.inner_target}"
    )
    if inj.inner_target == "self":
        return replacement
    if mode == "validate" and spec.region_dispatch is True:
        replacement = InnerOutputCheck(
            f"{fqn}.{inj.inner_target}", replacement, spec.inner_out_src, mesh
        )
    set_forward(journal, target, replacement)
    return None


def install(
    model: nn.Module,
    plan: ShardingPlan,
    mesh: DeviceMesh,
    mode: str,
    pre: PreflightResult,
    journal: Journal,
    *,
    reductions: Sequence[GradReduction] = (),
    reduce: bool = True,
    check_inputs: bool = True,
    streams: bool = True,
    fallback: SequenceFallback | None = None,
) -> AppliedModel:
    """Shard, wrap and hook ``model`` by ``plan``; every mutation goes through ``journal``.

    ``reductions`` are the gradient reductions the verifier derived (parameters named by
    FQN); ``reduce=False`` installs none, ``check_inputs=False`` no input guard and
    ``streams=False`` no random streams (the verifier's copies: nothing that communicates).
    In validate mode every dispatching region refuses an implicit DTensor redistribution:
    communication the contract does not declare.
    """
    if mode == "validate":  # its regions run on DTensors: the kernels they dispatch need strategies
        register_missing_strategies()
        register_partial_gradient_rules()
    # Every collective of the install comes first, before the model is touched: after them
    # the install is local, so a rank failing there cannot leave another waiting in one.
    journal.phase("communication")
    guard = (
        InputGuard(type(model).__name__, mesh, plan.modules, fallback=fallback)
        if check_inputs
        else None
    )
    rng = RngStreams(mesh) if streams else None
    sharded = shard_parameters(model, plan, mesh, mode, experts=pre.experts)
    journal.phase("hooks")
    if streams:  # the real install (the verifier's copies have no outer wrapper to check)
        OuterWrapperCheck(type(model).__name__, mesh).attach(model, journal)
    if guard is not None:
        guard.attach(model, journal)  # first hook of the root: before any collective of a forward
    if rng is not None:
        rng.attach(model, journal)
    journal.phase("parameters")
    sharded.install(model, journal)
    layouts = named_layouts(model, sharded.layouts) if mode == "production" else {}
    fused = {
        name: sharded.fused[id(p)]
        for name, p in model.named_parameters(remove_duplicate=False)
        if id(p) in sharded.fused
    }
    if mode == "production":  # validate's parameters are DTensors: their state dict has layouts
        ShardedStateDict(layouts).attach(model, journal)
        watch_optimizers(model, journal)  # and so do their optimizer states
    elif fused:  # validate's re-arranged fused DTensors: saved in the model's own layout
        FusedStateDict(fused).attach(model, journal)
        watch_optimizers(model, journal)  # and their moments too
    journal.phase("boundaries")
    strict = mode == "validate"  # validate refuses communication the contract does not declare
    dense = dense_mesh(mesh)  # hp's DTensors and collectives live off the dp axes
    forwards: dict[str, BoundaryForward] = {}
    wraps: dict[str, InnerWrap] = {}
    for fqn, spec in plan.items():
        if not spec.is_boundary:
            continue
        journal.at(fqn)
        module = model.get_submodule(fqn) if fqn else model
        replacement = _inner_wrap(fqn, module, plan, dense, mode, pre, journal, wraps)
        compute, dispatch = _compute_for(fqn, module, plan, dense, mode, pre)
        bf = BoundaryForward(
            fqn,
            module,
            spec,
            dense,
            mode,
            compute=compute or replacement,
            dispatch=dispatch,
            strict=strict,
            rng=rng,
            fix_match=fix_match(fqn, plan.modules),
            nested=nested_layouts(plan, fqn),
        )
        forward: Any = bf
        if guard is not None and fallback is not None:
            whole = BoundaryForward(
                fqn,
                module,
                fallback.variant[fqn],
                dense,
                mode,
                compute=compute or replacement,
                dispatch=dispatch,
                strict=strict,
                rng=rng,
                fix_match=bf.fix_match,
                nested=nested_layouts(plan, fqn),
            )
            forward = SequenceSwitch(bf, whole, fallback)
        set_forward(journal, module, forward)
        forwards[fqn] = bf
    journal.phase("attributes")
    for fqn, spec in plan.items():
        # A region on local tensors in validate too (re-arranged fused projections) needs them.
        if mode == "production" or (spec._fused_layouts and spec.region_dispatch is False):
            journal.at(fqn)
            module = model.get_submodule(fqn) if fqn else model
            for attr, (_glob, local) in (spec._tp_local_attr_plan or {}).items():
                if attr != INPUT_WIDTH:  # no attribute: the boundary's forward shows it local
                    set_local_attr(journal, module, attr, local)
    journal.phase("gradient reductions")
    entries = [*reductions, *expert_grad_reductions(plan, pre.experts)]
    reducer = (
        GradReducer.build(model, entries, dense, mode)
        if reduce and (entries or mode == "validate")
        else None
    )
    if reducer is not None:
        reducer.attach(model, journal)
    journal.phase("loss")
    if plan.loss_parallel:
        _install_loss(model, mesh, journal)
    meshes = {ep: groups.mesh for ep, groups in pre.experts.items()}
    state = AppliedModel(
        plan,
        mode,
        mesh,
        forwards,
        reducer,
        meshes,
        guard=guard,
        rng=rng,
        fallback=fallback if guard else None,
        inner_wraps=wraps,
        context=pre.context,
        layouts=layouts,
        fused=fused,
    )
    journal.set_attr(model, "_hp_applied", state)
    journal.phase("commit")  # after the last mutation
    return state


def _install_loss(model: nn.Module, mesh: DeviceMesh, journal: Journal) -> None:
    group = _tp_group(mesh)
    if group is None:
        return
    had = "_loss_function" in model.__dict__
    old = model.__dict__.get("_loss_function")
    # nn.Module.__setattr__ is typed for tensors and modules; HF reads a plain callable here.
    model.loss_function = VocabParallelCausalLMLoss(group)  # type: ignore[assignment]

    def undo() -> None:
        if had:
            model.__dict__["_loss_function"] = old
        else:
            model.__dict__.pop("_loss_function", None)

    journal.record(undo)
