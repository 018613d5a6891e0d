"""Preflight: everything ``apply`` can check without touching the model (docs/plans.md, "Applying").

Runs on every rank; the ranks then exchange their plan fingerprint and their verdict
in one collective, so a divergent plan or a rank-local failure is an error on every
rank instead of a deadlock later. With expert parallelism a second phase follows the
exchange: it creates the expert meshes (a collective that every rank must reach, hence
only after the verdict) and binds the expert-parallel compute factories, then the ranks
exchange their verdict once more.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from hp_core.context import ParallelContext
from hp_core.injection import InjectionBindingError, Target, check_forward_compatible
from hp_core.mesh import MeshSpec
from hp_core.plan_items import resolve_value
from hp_core.planner.lints import PlanningError, attr_value, lint_plan
from hp_core.planner.local_width import INPUT_WIDTH
from hp_core.planner.structure import model_architectures
from hp_core.plans.model import ShardingPlan
from hp_core.plugins import INNER_WRAPPER_REGISTRY, suggest_compute_factory
from hp_core.resolve import ResolvedInjection
from hp_core.runtime.errors import MeshMismatchError, PlanMismatchError, PreflightError
from hp_core.runtime.experts import (
    ExpertGroups,
    ExpertLayout,
    ExpertParallelError,
    build_expert_groups,
    check_expert_boundary,
    expert_layout,
    expert_matches,
    override_entries,
)
from hp_core.runtime.verdict import Verdict, VerdictExchange, failures, mismatches, resolve_timeout
from hp_core.spec.keywords import close_matches
from hp_core.spec.module_spec import ModuleShardingSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hp_core.verifier.report import VerifyReport

__all__ = [
    "InjectionPlan",
    "PreflightResult",
    "check_locally",
    "fingerprint_of",
    "preflight",
]

MODES = ("production", "validate")


@dataclasses.dataclass
class InjectionPlan:
    """What preflight resolved for one boundary's injections."""

    inner_wrapper: ResolvedInjection | None = None
    inner_target: str | None = None
    local_compute: ResolvedInjection | None = None
    compute_fn: Callable[..., Any] | None = None


@dataclasses.dataclass
class PreflightResult:
    """What preflight resolved: each boundary's injections and the job's parallel context."""

    injections: dict[str, InjectionPlan]
    #: The parallel context every injection receives as ``ctx`` (None before the mesh check).
    context: ParallelContext | None = None
    #: ep size → the expert mesh and replica group.
    experts: dict[int, ExpertGroups] = dataclasses.field(default_factory=dict)
    #: What the verifier proved, when it ran.
    report: VerifyReport | None = None


def _yaml_cp_fix(fqn: str) -> str:
    return (
        '  - match: "*.self_attn"\n    when: cp\n    inner_target: self\n'
        "    inner_wrapper: sdpa_hf\n    region_dispatch: false"
    )


def _check_mesh(plan: ShardingPlan, mesh: DeviceMesh) -> None:
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None or not hasattr(mesh, "get_group"):
        raise MeshMismatchError(
            "apply() needs a torch DeviceMesh with mesh_dim_names (e.g. init_device_mesh('cpu', "
            f"(2,), mesh_dim_names=('tp',))), got {type(mesh).__name__}."
        )
    actual = MeshSpec.from_any(mesh)
    planned = dict(
        zip(
            plan.mesh_axis_names,
            plan.mesh_shape or (None,) * len(plan.mesh_axis_names),
            strict=True,
        )
    )
    missing = [a for a in planned if a not in actual]
    if missing:
        raise MeshMismatchError(
            f"the plan was made for axes {list(planned)} but the mesh {actual} lacks {missing}. "
            "Apply the plan on the mesh it was made for, or plan again for this mesh."
        )
    wrong = {
        a: (planned[a], actual.size(a))
        for a in planned
        if planned[a] is not None and planned[a] != actual.size(a)
    }
    if wrong:
        detail = ", ".join(f"{a}: plan {p}, mesh {m}" for a, (p, m) in wrong.items())
        raise MeshMismatchError(
            f"mesh sizes differ from the plan's ({detail}). Plan again for this mesh."
        )


def _check_modules(model: nn.Module, plan: ShardingPlan) -> dict[str, nn.Module]:
    modules = dict(model.named_modules())
    for fqn in plan:
        if fqn not in modules:
            best = close_matches(fqn, modules, n=3)
            hint = f" Close matches: {best}." if best else ""
            raise PreflightError(
                f"plan names module {fqn!r}, which the model does not have.{hint} Plan for this "
                "model."
            )
    return modules


def _bind_compute(
    fqn: str, resolved: ResolvedInjection, module: nn.Module, ctx: ParallelContext
) -> Callable[..., Any]:
    src = f"plan[{fqn!r}].local_compute_fn"
    compute = resolved.bind({"module": module, "ctx": ctx}, source=src)
    if not callable(compute):
        raise PreflightError(
            f"{fqn}: the @local_compute factory {resolved.name!r} returned {compute!r}; it must "
            "return compute_fn(module, *forward_args)."
        )
    check_forward_compatible(compute, module.forward, leading=1, source=src)
    return compute


def _resolve(
    fqn: str,
    spec: ModuleShardingSpec,
    module: nn.Module,
    plan: ShardingPlan,
    ctx: ParallelContext,
    archs: tuple[str, ...] = (),
) -> InjectionPlan:
    result = InjectionPlan()
    cp_active = ctx.cp_mesh is not None
    if (spec.inner_target is None) != (spec.inner_wrapper is None):
        have, lack = (
            ("inner_target", "inner_wrapper")
            if spec.inner_target is not None
            else ("inner_wrapper", "inner_target")
        )
        raise PreflightError(
            f"{fqn}: {have} is set but {lack} is not; an inner wrap needs both (which submodule, "
            f"and what replaces its forward). Add {lack}, e.g. inner_target: self."
        )
    if spec.has_injection and spec.region_dispatch is None:
        raise PreflightError(
            f"{fqn}: injected compute must declare region_dispatch explicitly: true if it is plain "
            "torch ops (validate dispatches DTensors through it), false if it communicates or "
            "uses custom kernels (it then runs on local tensors)."
        )
    if spec.region_dispatch is True and not spec.has_injection:
        raise PreflightError(
            f"{fqn}: region_dispatch=True without an injection is redundant; remove it (or set "
            "false if the module's own forward communicates)."
        )
    if spec.inner_wrapper is not None:
        target = spec.inner_target
        if target != "self":
            child = getattr(module, str(target), None)
            if not isinstance(child, nn.Module):
                children = [n for n, _ in module.named_children()]
                best = close_matches(str(target), children, n=1)
                hint = f" Did you mean {best[0]!r}?" if best else ""
                raise PreflightError(
                    f"{fqn}: inner_target {target!r} is not a child module of "
                    f"{type(module).__name__}.{hint} Children: {children}; use 'self' for the "
                    "module itself."
                )
            if spec.inner_out_src is None:
                raise PreflightError(
                    f"{fqn}: inner_target {target!r} is a child, so inner_out_src must say the "
                    "layout of its output ('first_input', or a placement mapping such as {tp: "
                    "shard(1)})."
                )
        resolved = resolve_value(plan, fqn, "inner_wrapper", spec.inner_wrapper)
        meta = _registry_meta(spec.inner_wrapper)
        if meta.get("needs_cp") and not cp_active:
            raise PreflightError(
                f"{fqn}: inner wrapper {resolved.name!r} is a context-parallel wrapper, but the "
                "mesh has no active cp axis. Add cp to the mesh, or guard the override with "
                "'when: cp'."
            )
        required = meta.get("region_dispatch")
        if required is not None and spec.region_dispatch is not required:
            raise PreflightError(
                f"{fqn}: inner wrapper {resolved.name!r} requires region_dispatch: "
                f"{str(required).lower()} (it "
                f"{'communicates' if required is False else 'is plain torch ops'}); the plan has "
                f"{spec.region_dispatch}."
            )
        result.inner_wrapper, result.inner_target = resolved, target
    if spec.local_compute_fn is not None:
        resolved = resolve_value(plan, fqn, "local_compute_fn", spec.local_compute_fn)
        result.local_compute = resolved
        if (
            spec._ep_size <= 1
        ):  # an expert-parallel factory is bound after the exchange (it needs ep_mesh)
            result.compute_fn = _bind_compute(fqn, resolved, module, ctx)
    if (
        spec._needs_cp_attn
        and cp_active
        and spec.inner_wrapper is None
        and spec.local_compute_fn is None
    ):
        raise PreflightError(
            f"{fqn}: attention under cp={ctx.size('cp')} needs a context-parallel attention "
            "wrapper (each rank holds only part of the sequence, so keys and values must be "
            f"gathered). Install hp-plugin-cp and add to your overrides:\n{_yaml_cp_fix(fqn)}"
        )
    if spec._ep_size > 1 and spec.local_compute_fn is None:
        # The model's architecture first, then the block's own class name.
        candidates = (*archs, type(module).__name__)
        name = next((n for n in map(suggest_compute_factory, candidates) if n), None)
        hint = (
            (
                f"(the factory registered for {candidates[0]}; hp plugins lists the factories "
                "installed.)"
            )
            if name
            else (
                f"(no installed plugin registers a factory for {candidates[0]}: install "
                "hp-plugin-moe, or write your own @local_compute factory; hp plugins lists the "
                "factories installed.)"
            )
        )
        entries = override_entries(
            expert_matches(plan, fqn),
            f"    local_compute_fn: {name or 'FACTORY'}\n    region_dispatch: false\n",
        )
        raise PreflightError(
            f"{fqn}: experts are sharded over ep={spec._ep_size} but no compute is declared; the "
            "MoE block needs an expert-parallel compute that dispatches tokens with all-to-all. "
            f"Add:\n{entries}{hint}"
        )
    if spec._ep_size > 1:
        check_expert_boundary(fqn, spec, module)
    return result


def _registry_meta(value: Any) -> dict[str, Any]:
    name = value.target if isinstance(value, Target) else value
    if isinstance(name, str) and name in INNER_WRAPPER_REGISTRY:
        return dict(INNER_WRAPPER_REGISTRY.get_item(name).meta)
    return {}


def _check_attrs(model: nn.Module, plan: ShardingPlan) -> None:
    for fqn, spec in plan.items():
        for attr, (glob, _local) in (spec._tp_local_attr_plan or {}).items():
            if attr == INPUT_WIDTH:  # the input's width, no attribute: checked as it runs
                continue
            module = model.get_submodule(fqn) if fqn else model
            value = attr_value(module, attr)
            if value != glob:
                raise PreflightError(
                    f"{fqn}.{attr} is {value!r} but the plan expects {glob} (it divides it by tp). "
                    "Was the plan made for another model, or was the model already parallelized?"
                )


def fingerprint_of(
    plan: Any, mode: str, report: Any = None, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Everything deciding which collectives a rank will issue, by name (compared across ranks)."""
    out = {
        "plan": plan.fingerprint()
        if isinstance(plan, ShardingPlan)
        else f"<{type(plan).__name__}>",
        "mode": str(mode),
    }
    if (
        report is not None
    ):  # the derived reductions decide the gradient all-reduces: they must agree too
        out["gradient reductions"] = hashlib.sha256(
            repr([(r.param, r.axes) for r in report.reductions]).encode()
        ).hexdigest()[:16]
    out.update(extra or {})
    return out


def _exchange(
    plan: ShardingPlan,
    error: BaseException | None,
    mode: str = "production",
    report: Any = None,
    *,
    exchange: VerdictExchange | None = None,
    phase: str = "preflight",
    extra: Mapping[str, str] | None = None,
) -> None:
    exchange = exchange or VerdictExchange(resolve_timeout(None))
    if not exchange.active:
        if error is not None:
            raise error
        return
    verdicts = exchange.exchange(
        phase, Verdict.of(error, phase, fingerprint_of(plan, mode, report, extra))
    )
    if error is not None:
        raise error
    failed = failures(verdicts)
    if failed:
        rank, v = next(iter(failed.items()))
        raise PlanMismatchError(
            f"apply() failed its preflight on rank(s) {sorted(failed)} (rank {rank}: {v.error}); "
            "no rank touched its model."
        )
    differ = mismatches(verdicts)
    if "mode" in differ:
        raise PlanMismatchError(
            f"ranks called apply() with different modes (by rank: {differ['mode']}); production "
            "and validate issue different collectives. Pass the same mode on every rank."
        )
    if "plan" in differ:
        by_rank = {r: fp[:12] for r, fp in differ["plan"].items()}
        raise PlanMismatchError(
            f"ranks hold different plans (fingerprints by rank: {by_rank}). Every rank must apply "
            "the same plan, or the collectives it implies would deadlock: build the plan "
            "identically on every rank (same model config, mesh, overrides and hp/plugin "
            "versions) or load one frozen artifact."
        )
    if differ:
        detail = "; ".join(f"{name} by rank: {values}" for name, values in differ.items())
        raise PlanMismatchError(
            f"ranks called apply() with different settings ({detail}). These change which "
            "collectives a rank issues; give every rank the same arguments, environment and "
            "installed plugins."
        )


def _expert_layouts(
    model: nn.Module, plan: ShardingPlan, mesh: DeviceMesh
) -> dict[int, ExpertLayout]:
    """ep size → ``ExpertLayout`` of the plan's expert-parallel boundaries (pure)."""
    layouts: dict[int, ExpertLayout] = {}
    spec_of: dict[int, str] = {}
    ranks: tuple[int, ...] = ()
    for fqn, spec in plan.items():
        if not spec.is_boundary or spec._ep_size <= 1:
            continue
        if not ranks:
            ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            if len(ranks) != world:
                raise ExpertParallelError(
                    f"{fqn}: expert parallelism derives its expert mesh from the dense region, "
                    f"which must span every rank of the job; the mesh has {len(ranks)} of {world} "
                    "ranks. Apply on a mesh over the whole world."
                )
        layout = expert_layout(fqn, spec, plan, MeshSpec.from_any(mesh), ranks)
        other = layouts.setdefault(spec._ep_size, layout)
        if other != layout:
            raise ExpertParallelError(
                f"{fqn}: its tokens are laid out differently from those of "
                f"{spec_of[spec._ep_size]} (another block with ep={spec._ep_size}), so their "
                "experts' replicas would need different gradient reductions. Give every "
                "expert-parallel block the same in_dst."
            )
        spec_of.setdefault(spec._ep_size, fqn)
    return layouts


def _bind_experts(
    model: nn.Module,
    plan: ShardingPlan,
    mesh: DeviceMesh,
    result: PreflightResult,
    layouts: dict[int, ExpertLayout],
) -> None:
    """Phase 2: create the expert meshes (collective), then bind the expert-parallel factories."""
    if result.context is None:  # check_locally sets it before this phase
        raise RuntimeError("preflight: experts bound before the local checks ran (a bug in hp).")
    result.experts = build_expert_groups(mesh, layouts)
    for fqn, inj in result.injections.items():
        if inj.local_compute is None or inj.compute_fn is not None:
            continue
        module = model.get_submodule(fqn) if fqn else model
        ctx = result.context.with_ep_mesh(result.experts[plan[fqn]._ep_size].mesh)
        try:
            inj.compute_fn = _bind_compute(fqn, inj.local_compute, module, ctx)
        except (PreflightError, InjectionBindingError):
            raise
        except Exception as e:  # the factory refused the module: name the boundary
            raise PreflightError(
                f"{fqn}: the @local_compute factory {inj.local_compute.name!r} refused this "
                f"module: {e}"
            ) from e


def check_locally(
    model: nn.Module, plan: ShardingPlan, mesh: DeviceMesh, mode: str
) -> PreflightResult:
    """Every check that needs no other rank; raises the first failure. Mutates nothing."""
    result = PreflightResult({})
    if not isinstance(model, nn.Module):
        raise PreflightError(
            f"apply(model, ...): model must be a torch.nn.Module, got {type(model).__name__} "
            f"{model!r:.60}."
        )
    if mode not in MODES:
        raise PreflightError(f"apply(mode={mode!r}): mode must be one of {MODES}.")
    if not isinstance(plan, ShardingPlan):
        raise PreflightError(
            f"apply() expects a ShardingPlan (from hp_core.plan(...)), got {type(plan).__name__}."
        )
    if getattr(model, "_hp_applied", None) is not None:
        raise PreflightError(
            f"this {type(model).__name__} was already parallelized by hp; apply a plan to an "
            "unsharded model."
        )
    if plan.loss_parallel and not hasattr(type(model), "loss_function"):
        raise PreflightError(
            "loss_parallel needs a model that computes its loss through 'loss_function' (Hugging "
            f"Face causal LMs do); {type(model).__name__} has none. Plan with loss_parallel=False."
        )
    _check_mesh(plan, mesh)
    modules = _check_modules(model, plan)
    try:
        lint_plan(model, plan.modules, MeshSpec.from_any(mesh))
    except PlanningError as e:
        raise PreflightError(f"the plan does not fit this model: {e}") from e
    _check_attrs(model, plan)
    ctx = ParallelContext.from_mesh(mesh, plan)
    result.context = ctx
    archs = model_architectures(model)
    for fqn, spec in plan.items():
        if spec.is_boundary:
            result.injections[fqn] = _resolve(fqn, spec, modules[fqn], plan, ctx, archs)
    return result


def preflight(
    model: nn.Module,
    plan: ShardingPlan,
    mesh: DeviceMesh,
    mode: str,
    *,
    verify: Callable[[PreflightResult], Any] | None = None,
    exchange: VerdictExchange | None = None,
    extra: Mapping[str, str] | None = None,
) -> PreflightResult:
    """Check everything; raise before any mutation. Collective: every rank must call it.

    ``verify(result)`` runs after the local checks and before the ranks exchange their
    verdicts, so a plan the verifier refuses fails on every rank before any other
    collective; its return value is kept as ``result.report``. ``extra``: more fingerprint
    entries the ranks must agree on (apply's flags, the installed plugins).
    """
    error: BaseException | None = None
    result = PreflightResult({})
    layouts: dict[int, ExpertLayout] = {}
    try:
        result = check_locally(model, plan, mesh, mode)
        layouts = _expert_layouts(model, plan, mesh)
        if verify is not None:
            result.report = verify(result)
    except BaseException as e:  # every rank must reach the exchange, even on an interrupt
        error = e
    _exchange(plan, error, mode, result.report, exchange=exchange, extra=extra)
    if layouts:
        try:
            _bind_experts(model, plan, mesh, result, layouts)
        except Exception as e:
            error = e
        _exchange(plan, error, mode, exchange=exchange, phase="expert meshes", extra=extra)
    return result
