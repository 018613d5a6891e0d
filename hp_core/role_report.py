"""``explain_roles(model, mesh)``: why each parameter has its role, and where it ends up.

One row per parameter: its role, the rule that decided it (an architecture-scoped
RoleRule, a ModuleRule, a general RoleRule as a name hint, the structure, or nothing:
unclaimed), the plugin that registered that rule, the boundary (and template) that
claims it and its placement on every mesh axis in the plan; an override that declares
the parameter is the deciding rule for its placement. Then the unclaimed parameters and
the fused projections under tp (the layout hp proved, or the refusal with its fix). A
refusal of the plan does not stop the report: it is recorded in :attr:`RoleReport.refusal`.

The planner records the provenance while it decides the roles (a dict beside the roles;
it never reaches the plan, so no fingerprint changes); this module only reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from hp_core.context import ParallelContext
from hp_core.errors import HpError
from hp_core.mesh import MeshLike, MeshSpec
from hp_core.planner.fused_layout import FusedLayout
from hp_core.planner.plan import check_plan_args, pick_template, registered_rules
from hp_core.planner.structure import ModelStructure, analyse
from hp_core.planner.templates.roles import Role, RoleSource
from hp_core.plans.example import training_call
from hp_core.plans.model import ShardingPlan
from hp_core.plans.overrides import OverridesLike, compile_glob, is_glob, load_overrides
from hp_core.plugins import TEMPLATE_REGISTRY
from hp_core.spec.placements import format_placement
from hp_core.verifier.advice import plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FusedRow", "RoleReport", "RoleRow", "explain_roles"]

_FUSED = (Role.FUSED_QKV, Role.FUSED_GATE_UP)
#: The provider of the core's own rules and of what the structure decides.
CORE = "core"


@dataclasses.dataclass(frozen=True)
class RoleRow:
    """One parameter: ``rule`` decided it (``via``: role_rule, name_hint, module_rule,
    structure, unclaimed, override), ``provider`` registered that rule; ``placements`` is
    axis → placement text in the plan (None when the plan was refused)."""

    fqn: str
    shape: tuple[int, ...]
    role: Role
    rule: str
    provider: str
    via: str
    boundary: str | None
    template: str | None
    placements: dict[str, str] | None
    #: What decided the role when an override decides the placement.
    role_rule: str = ""


@dataclasses.dataclass(frozen=True)
class FusedRow:
    """A fused projection under tp: the ``layout`` hp proved, or why it is kept whole, or the
    planner's ``refusal`` and its ``fix`` (the keep-whole override to paste)."""

    fqn: str
    role: Role
    layout: str | None = None
    refusal: str | None = None
    fix: str | None = None


@dataclasses.dataclass
class RoleReport:
    """What :func:`explain_roles` found; :meth:`text` renders it."""

    mesh: MeshSpec
    rows: list[RoleRow]
    fused: list[FusedRow]
    #: ``"ErrorType: message"`` when ``plan`` refused the model (the table is still complete).
    refusal: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def unclaimed(self) -> list[RoleRow]:
        """Parameters no rule decided (nor the structure): replicated by default."""
        return [r for r in self.rows if r.via == "unclaimed" or r.role_rule.startswith("unclaimed")]

    def row(self, fqn: str) -> RoleRow:
        """The row of parameter ``fqn``."""
        for r in self.rows:
            if r.fqn == fqn:
                return r
        raise KeyError(fqn)

    def text(self) -> str:
        """The report as plain text: the table, then unclaimed, fused and the refusal."""
        return render(self)


def _provider(item: str | None) -> str:
    """``core`` for the built-in plugin (and the structure), else ``name (distribution)``."""
    found = TEMPLATE_REGISTRY.get(item) if item is not None else None
    if found is None or found.provider == "builtin":
        return CORE
    return f"{found.provider} ({found.distribution})" if found.distribution else found.provider


def _placements(planned: ShardingPlan, axes: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """Param FQN → axis → placement text, from the innermost boundary declaring it."""
    out: dict[str, dict[str, str]] = {}
    depth: dict[str, int] = {}
    for fqn, spec in planned.modules.items():
        params = spec.params if isinstance(spec.params, dict) else {}
        for rel, named in params.items():
            for src in spec._ep_stack.get(rel) or [rel]:
                full = f"{fqn}.{src}" if fqn else src
                level = fqn.count(".") + bool(fqn)
                if depth.get(full, -1) >= level:
                    continue
                depth[full] = level
                out[full] = {
                    a: format_placement(named[a]) if a in named else "replicate" for a in axes
                }
    return out


def _overridden(
    overrides: OverridesLike | None, module_names: list[str], active: set[str]
) -> dict[str, str]:
    """Param FQN → the match of the last override entry that declares it."""
    out: dict[str, str] = {}
    for entry in load_overrides(overrides if overrides is not None else []):
        if entry.when is not None and entry.when not in active:
            continue
        if is_glob(entry.match):
            pattern = compile_glob(entry.match)
            hits = [m for m in module_names if pattern.fullmatch(m)]
        else:
            hits = [entry.match]
        params = entry.spec.params if isinstance(entry.spec.params, dict) else {}
        for fqn in hits:
            for rel in params:
                out[f"{fqn}.{rel}" if fqn else rel] = entry.match
    return out


def _fused_rows(
    structure: ModelStructure, planned: ShardingPlan | None, error: HpError | None
) -> list[FusedRow]:
    layouts: dict[str, FusedLayout] = {}
    declared: set[str] = set()
    if planned is not None:
        for fqn, spec in planned.modules.items():
            params = spec.params if isinstance(spec.params, dict) else {}
            declared.update(f"{fqn}.{r}" if fqn else r for r in params)
            for rel, data in spec._fused_layouts.items():
                layouts[f"{fqn}.{rel}" if fqn else rel] = FusedLayout.from_data(data)
    culprit = str(error).split(":", 1)[0] if error is not None else None
    rows: list[FusedRow] = []
    for fqn, role in structure.roles.items():
        if role not in _FUSED or fqn in structure.tied:
            continue
        if planned is not None:
            found = layouts.get(fqn)
            if found is not None:
                rows.append(FusedRow(fqn, role, layout=f"proven: {found.describe()}"))
            else:
                rows.append(FusedRow(fqn, role, layout="not split on its fused dim (kept whole)"))
        elif culprit is not None and (fqn == culprit or fqn.startswith(culprit + ".")):
            message = str(error)
            why, _, fix = message.partition("\nFix: ")
            rows.append(FusedRow(fqn, role, refusal=why, fix=fix or None))
        else:
            rows.append(FusedRow(fqn, role, layout="not proven (the plan was refused)"))
    return rows


def explain_roles(
    model: nn.Module,
    mesh: DeviceMesh | MeshLike,
    *,
    overrides: OverridesLike | None = None,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    ep_size: int = 1,
    example_inputs: Any = None,
) -> RoleReport:
    """Why each parameter of ``model`` has its role on ``mesh`` (see the module docstring).

    Takes :func:`hp_core.plan`'s arguments; bad arguments raise as there. A plan the
    planner refuses (a fused projection it cannot prove, a parameter nothing claims, ...)
    is reported in :attr:`RoleReport.refusal` instead of raised.
    """
    ms = check_plan_args(model, mesh, sequence_parallel, loss_parallel, ep_size)
    call = training_call(model, example_inputs)
    rules, module_rules, templates = registered_rules()
    structure = analyse(model, rules, module_rules, call)
    active = set(
        ParallelContext.from_spec(
            ms, sequence_parallel=sequence_parallel, ep_size=ep_size
        ).guard_axes
    )
    by_override = _overridden(overrides, structure.module_names, active)
    planned: ShardingPlan | None = None
    error: HpError | None = None
    try:
        planned = plan(
            model,
            ms,
            overrides=overrides,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            ep_size=ep_size,
            example_inputs=call if call.given else None,
        )
    except HpError as e:
        error = e
    where = _placements(planned, ms.axis_names) if planned is not None else {}
    claim: dict[str, tuple[str, str]] = {}
    for block in structure.blocks:
        template = pick_template(templates, block.kind, structure.architectures)
        for rel in block.params:
            full = f"{block.fqn}.{rel}" if block.fqn else rel
            claim[full] = (
                f"{block.kind} {block.fqn or '<root>'}",
                template.name if template else "",
            )
    axes = ms.axis_names if planned is not None else None
    rows = [
        _row(fqn, tuple(p.shape), structure, claim, where, by_override, axes)
        for fqn, p in model.named_parameters()
    ]
    refusal = f"{type(error).__name__}: {error}" if error is not None else None
    fused = _fused_rows(structure, planned, error) if ms.size("tp") > 1 else []
    return RoleReport(ms, rows, fused, refusal, list(structure.notes))


def _row(
    fqn: str,
    shape: tuple[int, ...],
    structure: ModelStructure,
    claim: Mapping[str, tuple[str, str]],
    where: Mapping[str, dict[str, str]],
    by_override: Mapping[str, str],
    axes: tuple[str, ...] | None,
) -> RoleRow:
    source = structure.sources.get(fqn, RoleSource("unclaimed", "unclaimed (no rule; replicated)"))
    boundary, template = claim.get(fqn, (None, None))
    placements: dict[str, str] | None = None
    if axes is not None:  # a parameter no boundary declares stays whole on every axis
        placements = dict(where.get(fqn) or {a: "replicate" for a in axes})
    rule, via, role_rule = source.rule, source.via, ""
    match = by_override.get(fqn)
    if match is not None:
        rule, via, role_rule = f"override {match!r}", "override", source.rule
    provider = "user" if match is not None else _provider(source.item)
    return RoleRow(
        fqn,
        shape,
        structure.roles[fqn],
        rule,
        provider,
        via,
        boundary,
        template or None,
        placements,
        role_rule,
    )


def render(report: RoleReport) -> str:
    """:meth:`RoleReport.text`."""
    axes = report.mesh.axis_names
    head = ["parameter", "shape", "role", "rule", "provider", *axes]
    table = [head]
    for r in report.rows:
        placed = r.placements or {}
        table.append(
            [
                r.fqn,
                "x".join(str(n) for n in r.shape) or "scalar",
                r.role.value,
                r.rule + (f" (role: {r.role_rule})" if r.role_rule else ""),
                r.provider,
                *(placed.get(a, "replicate" if r.placements is not None else "-") for a in axes),
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = [
        f"roles: mesh {report.mesh}; {len(report.rows)} parameters",
        "",
        *(
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in table
        ),
        "",
    ]
    unclaimed = report.unclaimed
    lines.append(
        f"unclaimed (no rule or structure decided the role; replicated): {len(unclaimed) or 'none'}"
    )
    lines += [f"  {r.fqn} ({'x'.join(map(str, r.shape))})" for r in unclaimed]
    if report.fused:
        lines += ["", "fused projections under tp:"]
        for f in report.fused:
            if f.refusal is None:
                lines.append(f"  {f.fqn} ({f.role.value}): {f.layout}")
            else:
                lines.append(f"  {f.fqn} ({f.role.value}): refused: {f.refusal}")
                fix = f.fix.rstrip().split("\n") if f.fix else []
                lines += [f"    {'Fix: ' if i == 0 else ''}{line}" for i, line in enumerate(fix)]
    shown = any(f.refusal is not None for f in report.fused)
    if report.refusal is None:
        lines += ["", "plan: ok"]
    elif shown:
        lines += ["", f"plan: refused ({report.refusal.split(':', 1)[0]}, shown above)"]
    else:
        lines += ["", f"plan: refused: {report.refusal}"]
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines).rstrip("\n") + "\n"
