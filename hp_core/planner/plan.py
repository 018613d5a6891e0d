"""``plan(model, mesh)``: model structure + mesh + overrides → ``ShardingPlan`` (docs/plans.md).

Pure: it reads names, shapes and the module tree, so it works on a meta-device model
and a mesh that is only names and sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.tensor import Shard

from hp_core.context import ParallelContext
from hp_core.mesh import MeshLike, MeshSpec
from hp_core.plan_items import check_plan_items
from hp_core.planner.fused_layout import fused_layouts
from hp_core.planner.fused_proof import prove_fused_layouts
from hp_core.planner.lints import (
    MeshTypeError,
    PlanningError,
    TemplateBuildError,
    compute_deferred_biases,
    compute_tp_local_attrs,
    lint_plan,
)
from hp_core.planner.local_proof import prove_local_programs
from hp_core.planner.structure import Block, analyse
from hp_core.planner.templates.context import TemplateContext
from hp_core.planner.templates.mixers import kept_whole_note
from hp_core.planner.templates.module_rules import ModuleRule
from hp_core.planner.templates.roles import BoundaryTemplate, RoleRule
from hp_core.planner.unclaimed import check_unclaimed
from hp_core.plans.errors import ArgumentTypeError, PlanError
from hp_core.plans.example import left_out_note, training_call
from hp_core.plans.model import ShardingPlan
from hp_core.plans.overrides import OverridesLike, resolve_overrides
from hp_core.plugins import TEMPLATE_REGISTRY
from hp_core.spec.module_spec import ModuleShardingSpec
from hp_core.spec.placements import NamedPlacement

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["check_plan_args", "pick_template", "plan", "registered_rules"]


def _registered() -> tuple[list[RoleRule], list[BoundaryTemplate]]:
    values = [i.value for i in TEMPLATE_REGISTRY.values()]
    rules = [v for v in values if isinstance(v, RoleRule)]
    return rules, [v for v in values if isinstance(v, BoundaryTemplate)]


def _module_rules() -> list[ModuleRule]:
    return [i.value for i in TEMPLATE_REGISTRY.values() if isinstance(i.value, ModuleRule)]


def registered_rules() -> tuple[list[RoleRule], list[ModuleRule], list[BoundaryTemplate]]:
    """The role rules, module rules and boundary templates the planner uses now."""
    rules, templates = _registered()
    return rules, _module_rules(), templates


def pick_template(
    templates: Sequence[BoundaryTemplate], kind: str, archs: Sequence[str]
) -> BoundaryTemplate | None:
    """Architecture-scoped templates win over general ones; among equals, the last registered
    (plugins and users register after the built-in plugin)."""
    candidates = [t for t in templates if t.kind == kind and t.applies_to(archs)]
    scoped = [t for t in candidates if t.architectures]
    pool = scoped or candidates
    return pool[-1] if pool else None


def _provider_of(template: BoundaryTemplate) -> str:
    """Who registered ``template``, in words (the registry knows; a template not found there
    was handed to the planner some other way)."""
    item = TEMPLATE_REGISTRY.get(template.name)
    if item is not None and item.value is template:
        return item.describe_provider()
    return "no registered provider"


def _who_fixes(provider: str) -> str:
    if provider.startswith("provider 'user'"):
        return "correct the template you registered with register_template"
    return f"report it to {provider} with this model"


def _build(template: BoundaryTemplate, ctx: TemplateContext) -> Any:
    """``template.build(ctx)``; a failure becomes TemplateBuildError naming the template, its
    provider and the module. PlanErrors (which name the module) and KeyboardInterrupt pass."""
    try:
        return template.build(ctx)
    except PlanError:
        raise
    except Exception as e:
        fqn = ctx.fqn
        provider = _provider_of(template)
        raise TemplateBuildError(
            f"{fqn or '<root>'}: boundary template {template.name!r} (kind {template.kind!r}, from "
            f"{provider}) "
            f"failed to build the spec of {type(ctx.block.module).__name__} {fqn!r}: "
            f"{type(e).__name__}: {e}\n"
            f"Fix: {_who_fixes(provider)}; meanwhile declare the module's full contract yourself "
            "in "
            f"an override (match: {fqn!r}), or unregister the template. The original exception is "
            "chained below.",
            template=template.name,
            provider=provider,
            fqn=fqn,
        ) from e


def _not_called(block: Block, ctx: TemplateContext) -> tuple[ModuleShardingSpec, str]:
    """A block whose forward the traced call never runs: its parameters are declared whole
    (``is_boundary: false``), since a boundary there would never see its data."""
    params = {rel: ctx.replicated() for rel in block.params}
    spec = ModuleShardingSpec(is_boundary=False, params={k: v for k, v in params.items() if v})
    note = (
        f"{block.fqn} ({type(block.module).__name__}) is kept whole, its parameters replicated: "
        "the traced call never runs its forward (its parent's code calls its children), so hp "
        "cannot wrap it. To shard it, give its parent a contract through an override or a plugin "
        "template"
    )
    return spec, note


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_model(model: Any) -> None:
    if isinstance(model, nn.Module):
        return
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        hint = (
            " plan() takes the model object, not its name or path: build it first (on the meta "
            "device is enough), e.g. with torch.device('meta'): model = "
            "AutoModelForCausalLM.from_config(config). "
            "From the command line, 'hp plan --model PATH' takes a path."
        )
    else:
        hint = " Pass the torch.nn.Module to parallelize (a meta-device copy is enough to plan)."
    raise ArgumentTypeError(
        f"plan(model, mesh): model must be a torch.nn.Module, got {type(model).__name__} "
        f"{_short(model)}.{hint}"
    )


def _check_mesh(mesh: object) -> None:
    if isinstance(mesh, (MeshSpec, str, Mapping)) or (
        getattr(mesh, "shape", None) is not None and hasattr(mesh, "get_group")
    ):
        return
    raise MeshTypeError(
        f"plan(model, mesh): mesh: expected a DeviceMesh, a MeshSpec, an {{axis: size}} mapping "
        "such as "
        f"{{'tp': 2}} or a string such as 'tp=2,cp=2', got {type(mesh).__name__} {_short(mesh)}. "
        "Example: hp_core.plan(model, 'tp=2'); a DeviceMesh needs mesh_dim_names."
    )


def _check_flags(sequence_parallel: Any, loss_parallel: Any, ep_size: Any) -> None:
    for name, value in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)):
        if not isinstance(value, bool):
            raise PlanningError(f"plan(): {name} must be True or False, got {value!r}")
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise PlanningError(f"plan(): ep_size must be a positive integer, got {ep_size!r}")


def _check_loss(model: nn.Module) -> None:
    """Loss parallelism replaces the model's loss function: only one whose semantics hp's
    vocab-parallel cross-entropy reproduces (transformers' causal-LM loss) may be replaced."""
    loss = getattr(type(model), "loss_function", None)
    if loss is None:
        return  # preflight refuses models without one
    current = getattr(model, "loss_function", None)
    qualname = getattr(current, "__qualname__", type(current).__name__)
    name = f"{getattr(current, '__module__', '?')}.{qualname}"
    if name != "transformers.loss.loss_utils.ForCausalLMLoss":
        raise PlanningError(
            f"plan(loss_parallel=True): {type(model).__name__} computes its loss with {name}, not "
            "transformers' "
            "causal-LM cross-entropy, and hp's vocab-parallel loss would replace it with something "
            "else. "
            "Plan with loss_parallel=False (the logits are then gathered and your loss runs "
            "unchanged)."
        )


def check_plan_args(
    model: nn.Module,
    mesh: DeviceMesh | MeshLike,
    sequence_parallel: bool,
    loss_parallel: bool,
    ep_size: int,
) -> MeshSpec:
    """Refuse arguments :func:`plan` cannot take (the model, the mesh, the flags, a loss
    parallelism the model's loss does not allow); returns the mesh as a MeshSpec."""
    _check_model(model)
    _check_mesh(mesh)
    ms = MeshSpec.from_any(mesh)
    _check_flags(sequence_parallel, loss_parallel, ep_size)
    if loss_parallel:
        _check_loss(model)
    return ms


def plan(
    model: nn.Module,
    mesh: DeviceMesh | MeshLike,
    *,
    overrides: OverridesLike | None = None,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    ep_size: int = 1,
    check_items: bool = True,
    example_inputs: Any = None,
) -> ShardingPlan:
    """Derive every boundary's contract for ``model`` on ``mesh`` and merge ``overrides``.

    ``mesh`` is a ``DeviceMesh``, a :class:`~hp_core.MeshSpec`, ``{"tp": 8}`` or
    ``"tp=8,cp=2"``; ``overrides`` a ``{fqn_or_glob: ModuleShardingSpec}`` dict, a list of
    YAML-style entries, or a path to a YAML file. Nothing is mutated.

    ``check_items``: resolve every injection of the result (registry names, import paths,
    ``Target`` config keys) as ``hp_core.apply``'s preflight does, and raise the error apply
    would raise (e.g. :class:`~hp_core.plugins.UnknownRegistryItemError`), naming
    ``plan['fqn'].field``. Pass False to plan on a machine without the plugins the plan
    names (the plan is then checked when it is applied).
    """
    ms = check_plan_args(model, mesh, sequence_parallel, loss_parallel, ep_size)
    if not isinstance(check_items, bool):
        raise PlanningError(f"plan(): check_items must be True or False, got {check_items!r}")
    call = training_call(model, example_inputs)
    rules, templates = _registered()
    structure = analyse(model, rules, _module_rules(), call)
    derived: dict[str, ModuleShardingSpec] = {}
    uncalled: list[str] = []
    first_layer = True
    for block in structure.blocks:
        template = pick_template(templates, block.kind, structure.architectures)
        if template is None:
            raise PlanningError(
                f"{block.fqn}: no boundary template for kind {block.kind!r} is registered. The "
                "built-in plugin provides one for every kind; is hp-core's builtin plugin failing? "
                "Run 'hp plugins'."
            )
        ctx = TemplateContext(
            block,
            ms,
            sequence_parallel,
            loss_parallel,
            ep_size,
            is_first_layer=first_layer,
            architectures=structure.architectures,
        )
        spec = _build(template, ctx)
        if block.kind == "layer":
            first_layer = False
        if spec is None:
            continue
        if block.called is False and isinstance(spec, ModuleShardingSpec) and spec.is_boundary:
            spec, note = _not_called(block, ctx)
            uncalled.append(note)
        if not isinstance(spec, ModuleShardingSpec):
            raise PlanningError(
                f"{block.fqn}: template {template.name!r} returned {type(spec).__name__}, not a "
                "ModuleShardingSpec (or None to skip the block)."
            )
        derived[block.fqn] = spec
    active = set(
        ParallelContext.from_spec(
            ms, sequence_parallel=sequence_parallel, ep_size=ep_size
        ).guard_axes
    )
    modules, notes = resolve_overrides(
        derived,
        overrides if overrides is not None else [],
        module_names=structure.module_names,
        active=active,
        mesh_axis_names=ms.axis_names,
    )
    if ms.size("tp") > 1:
        kept = (kept_whole_note(b) for b in structure.blocks if b.fqn in derived)
        notes = [*(n for n in kept if n is not None), *notes]
    if "tp" in ms or "cp" in ms:  # as lint_plan's coverage check: else nothing is sharded
        shards = ms.size("tp") > 1 and sequence_parallel
        sequence: NamedPlacement | None = None
        if shards:
            sequence = {a: Shard(1) for a in ("cp", "tp") if a in ms}
        check_unclaimed(structure, modules, model, sequence, call)
    lint_plan(model, modules, ms, structure.roles)
    for fqn, spec in modules.items():
        facts: dict[str, Any] = {"deferred_bias_params": compute_deferred_biases(model, fqn, spec)}
        if ms.size("tp") > 1:
            facts["fused_layouts"] = fused_layouts(model, fqn, spec, ms, structure.roles)
        spec.with_derived(**facts)
    if ms.size("tp") > 1:
        prove_fused_layouts(model, modules, ms, call)  # what the forward shows, or a refusal
        attention = [b.fqn for b in structure.blocks if b.kind == "attention"]
        for fqn, spec in modules.items():
            local = compute_tp_local_attrs(model, fqn, spec, ms, attention=fqn in attention)
            spec.with_derived(tp_local_attr_plan=local)
        # What production runs, or a refusal:
        prove_local_programs(model, modules, attention, ms, call)
    result = ShardingPlan(
        modules=modules,
        mesh_axis_names=ms.axis_names,
        mesh_shape=ms.sizes,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        ep_size=ep_size,
        notes=[*structure.notes, *uncalled, *notes, *filter(None, [left_out_note(model, call)])],
        example=call if call.given else None,
    )
    if check_items:
        check_plan_items(result)
    return result
