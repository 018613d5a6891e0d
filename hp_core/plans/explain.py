"""``explain(plan)``: a plan as plain, greppable text (what ``hp plan`` prints).

Per boundary, in model order: its parameters and their placements, each entry and exit
transition with the collective it costs (forward and backward, from
:mod:`hp_core.collectives`'s table), injections, attribute changes, deferred biases and
expert-parallel stacking; at the end the collectives of one training step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch.distributed.tensor import Placement

from hp_core.collectives import Transition
from hp_core.injection import Target
from hp_core.plans.errors import PlanError
from hp_core.plans.prediction import (
    boundary_transitions,
    input_check_axes,
    plugin_collectives,
    reduction_axes,
    sp_grad_params,
    step_collectives,
)
from hp_core.spec.module_spec import ModuleShardingSpec
from hp_core.spec.placements import PlacementSyntaxError, format_placement

if TYPE_CHECKING:
    from hp_core.plans.model import ShardingPlan

__all__ = ["explain"]

_INDENT = "  "


def _p(placement: Any) -> str:
    if isinstance(placement, Placement):
        try:
            return format_placement(placement)
        except PlacementSyntaxError:
            return repr(placement)
    return str(placement)


def _layout(named: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{axis}: {_p(p)}" for axis, p in named.items()) + "}"


def _injection(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Target):
        config = ", ".join(f"{k}={v!r}" for k, v in value.config.items())
        return f"{value.target}({config})" if config else value.target
    module, qual = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if isinstance(module, str) and isinstance(qual, str):
        return f"{module}.{qual}"
    return repr(value)


def _transition_line(t: Transition) -> str:
    if t.src == t.dst:
        change, fwd = f"{_p(t.src)} on {t.axis}", t.forward or "unchanged"
    else:
        change, fwd = f"{_p(t.src)}→{_p(t.dst)} on {t.axis}", t.forward or "no communication"
    bwd = f" (bwd {t.backward})" if t.backward else ""
    return f"{t.side} {t.name}: {change}: {fwd}{bwd}"


def _unpaired(side: str, src: Any, dst: Any) -> list[str]:
    src = src if isinstance(src, dict) else {}
    dst = dst if isinstance(dst, dict) else {}
    lines = [
        f"{side} {n}: {_layout(src[n])} (no {side}_dst entry: passed on as is)"
        for n in src
        if n not in dst
    ]
    lines += [
        f"{side} {n}: → {_layout(dst[n])} (no {side}_src entry: arrives as is)"
        for n in dst
        if n not in src
    ]
    return lines


def _injection_lines(spec: ModuleShardingSpec) -> list[str]:
    parts = []
    if spec.local_compute_fn is not None:
        parts.append(f"local_compute_fn={_injection(spec.local_compute_fn)}")
    if spec.inner_wrapper is not None:
        parts.append(f"inner_wrapper={_injection(spec.inner_wrapper)}")
    if spec.inner_target is not None:
        parts.append(f"inner_target={spec.inner_target}")
    if isinstance(spec.inner_out_src, str):
        parts.append(f"inner_out_src={spec.inner_out_src}")
    elif isinstance(spec.inner_out_src, dict):
        inner = ", ".join(f"{k}: {_layout(v)}" for k, v in spec.inner_out_src.items())
        parts.append(f"inner_out_src={{{inner}}}")
    if spec.region_dispatch is not None:
        parts.append(f"region_dispatch={str(spec.region_dispatch).lower()}")
    return [f"injections: {', '.join(parts)}"] if parts else []


def _sizes(plan: ShardingPlan) -> dict[str, int] | None:
    """The mesh's axis sizes, or None for a mesh of names only."""
    if not plan.mesh_shape:
        return None
    return dict(zip(plan.mesh_axis_names, plan.mesh_shape, strict=True))


def _plugin_lines(fqn: str, spec: ModuleShardingSpec, plan: ShardingPlan) -> list[str]:
    """Per registry item the boundary names: the collectives it declares for one call."""
    sizes = _sizes(plan)
    by_item: dict[str, Counter[str]] = {}
    for c in plugin_collectives(fqn, spec, sizes) if sizes is not None else ():
        item = c.where.removeprefix(f"{fqn} ").split(": ", 1)[0]
        by_item.setdefault(item, Counter())[f"{c.phase} {c.op} on {c.axis}"] += 1
    return [
        f"collectives per call of {item}: " + ", ".join(f"{op} x{n}" for op, n in ops.items())
        for item, ops in by_item.items()
    ]


def _boundary_lines(fqn: str, spec: ModuleShardingSpec, plan: ShardingPlan) -> list[str]:
    lines: list[str] = []
    params = spec.params if isinstance(spec.params, dict) else {}
    if params:
        lines.append("params:")
        lines += [f"{_INDENT}{rel}: {_layout(named)}" for rel, named in params.items()]
    else:
        lines.append("params: none")
    if not spec.is_boundary:
        lines.append("not a boundary: parameters only, forward is not wrapped")
    else:
        transitions = boundary_transitions(fqn, spec)
        lines += [_transition_line(t) for t in transitions if t.side == "in"]
        lines += _unpaired("in", spec.in_src, spec.in_dst)
        lines += [_transition_line(t) for t in transitions if t.side == "out"]
        lines += _unpaired("out", spec.out_src, spec.out_dst)
        if not transitions and not any(
            isinstance(v, dict) and v
            for v in (spec.in_src, spec.out_src, spec.in_dst, spec.out_dst)
        ):
            lines.append("in/out: no layouts declared (nothing is redistributed)")
        if isinstance(spec.out_names, list):
            lines.append(f"out names: {', '.join(spec.out_names)}")
    lines += _injection_lines(spec)
    lines += _plugin_lines(fqn, spec, plan)
    if spec._tp_local_attr_plan:
        attrs = ", ".join(f"{a} {g}→{loc}" for a, (g, loc) in spec._tp_local_attr_plan.items())
        lines.append(f"attrs (divided by tp): {attrs}")
    for rel, data in spec._fused_layouts.items():
        parts = ", ".join(f"{n} {p}" for n, p in zip(data["names"], data["parts"], strict=True))
        lines.append(f"fused {rel}: {data['kind']} along dim {data['dim']} [{parts}]")
    if spec._deferred_bias_params:
        lines.append(
            "deferred biases (added once after the exit reduction): "
            + ", ".join(spec._deferred_bias_params)
        )
    if spec._ep_size:
        lines.append(
            f"expert parallel: ep_size={spec._ep_size} over the derived (edp, ep) expert mesh"
        )
        for stacked, sources in spec._ep_stack.items():
            lines.append(
                f"{_INDENT}stack {stacked} ← {sources[0]} … {sources[-1]} ({len(sources)} experts)"
                if len(sources) > 1
                else f"{_INDENT}stack {stacked} ← {sources[0]}"
            )
    if spec._needs_cp_attn and "cp" in plan.mesh_axis_names and spec.inner_wrapper is None:
        lines.append(
            "attention under cp: needs a CP inner wrapper, none set yet (e.g. inner_wrapper: "
            "sdpa_hf from hp-plugin-cp)"
        )
    if spec._is_terminal:
        lines.append("terminal: its output is the model's logits")
    return lines


def _mesh_text(plan: ShardingPlan) -> str:
    if plan.mesh_shape is None:
        return "mesh " + ",".join(plan.mesh_axis_names)
    world = 1
    for n in plan.mesh_shape:
        world *= n
    pairs = ",".join(f"{a}={n}" for a, n in zip(plan.mesh_axis_names, plan.mesh_shape, strict=True))
    return f"mesh {pairs} ({world} devices)"


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def explain(plan: ShardingPlan, report: Any = None) -> str:
    """The plan as plain text: per boundary its params, transitions, injections, attrs; then
    the predicted collectives of one training step (forward + backward)."""
    # Duck-typed: the plan model imports this module for ShardingPlan.explain().
    if not (hasattr(plan, "modules") and hasattr(plan, "mesh_axis_names")):
        raise PlanError(f"explain: expected a ShardingPlan, got {type(plan).__name__}.")
    n_boundaries = sum(1 for s in plan.modules.values() if s.is_boundary)
    try:
        fingerprint = plan.fingerprint()[:16]
    except PlanError as e:  # e.g. a placement with no DSL form; explain the rest anyway
        fingerprint = f"unavailable ({e})"
    out = [
        f"hp plan: {_mesh_text(plan)}; sequence parallel {_on_off(plan.sequence_parallel)}; "
        f"loss parallel {_on_off(plan.loss_parallel)}; ep_size {plan.ep_size}",
        f"{len(plan.modules)} modules planned ({n_boundaries} boundaries); fingerprint "
        f"{fingerprint}",
    ]
    example = getattr(plan, "example", None)
    if example is not None:
        out.append(f"planned and verified on the training call {example.describe()}")
    for fqn, spec in plan.modules.items():
        out.append("")
        out.append(fqn or "<root>")
        out += [_INDENT + line for line in _boundary_lines(fqn, spec, plan)]

    out.append("")
    out.append("collectives per training step (predicted, one forward + one backward):")
    reductions = report.reductions if report is not None else None
    checks = input_check_axes(plan.mesh_axis_names, plan.mesh_shape) if plan.mesh_shape else []
    counts = step_collectives(
        plan.modules,
        loss_parallel=plan.loss_parallel,
        reductions=reductions,
        check_axes=checks,
        sizes=_sizes(plan),
    )
    if not counts:
        out.append(f"{_INDENT}none")
    for phase in ("forward", "backward"):
        rows = sorted((op, axis, n) for (ph, op, axis), n in counts.items() if ph == phase)
        if rows:
            out.append(f"{_INDENT}{phase}: {sum(n for _, _, n in rows)}")
            out += [f"{_INDENT * 2}{op} on {axis}: {n}" for op, axis, n in rows]
    for axis in checks:
        out.append(
            f"{_INDENT}(forward all_reduce on {axis} includes 1 input check: the ranks compare "
            "their input shapes before the first collective; apply(check_inputs=False) drops it)"
        )
    if plan.loss_parallel:
        out.append(
            f"{_INDENT}(forward all_reduce on tp includes the vocab-parallel cross-entropy's 2: "
            "the max, then the sum of exponentials with the target logit)"
        )
    sizes = _sizes(plan)
    declared = Counter(
        (c.phase, c.op, c.axis)
        for fqn, spec in plan.modules.items()
        for c in (plugin_collectives(fqn, spec, sizes) if sizes is not None else ())
    )
    order = sorted(declared.items(), key=lambda kv: (kv[0][0] != "forward", kv[0]))
    for (phase, op, axis), n in order:
        out.append(
            f"{_INDENT}({phase} {op} on {axis} includes {n} declared by plugin items: their calls' "
            "own collectives, see 'collectives per call' above)"
        )
    for axis in reduction_axes(plan.modules, reductions):
        if reductions is not None:
            n = sum(1 for r in reductions if axis in r.axes)
            what = f"the {n} gradient(s) the verifier found partial over {axis}"
        elif axis == "tp":
            what = (
                f"the {len(sp_grad_params(plan.modules))} gradient(s) of tp-replicated parameters "
                "that see only this rank's sequence shard (hp plan --verify finds any others)"
            )
        else:
            what = (
                f"the gradients of parameters replicated on {axis} that see only this rank's "
                "share of the data"
            )
        out.append(
            f"{_INDENT}(backward all_reduce on {axis} includes one bucketed reduction of {what})"
        )
    if plan.notes:
        out.append("")
        out.append("override notes:")
        out += [f"{_INDENT}{note}" for note in plan.notes]
    return "\n".join(out) + "\n"
