"""Parameters no boundary template claimed: declared by an override, or refused with a fix.

A parameter the templates did not recognise (a stray scale, a learned position table on the
model itself) has no layout hp could derive. It is fine when an override declares it; else
the plan is refused, proposing to keep it whole — a fix hp checks before printing it
(:mod:`hp_core.verifier.advice`): under sequence parallel, a parameter used outside every
boundary may meet activations that are sharded in some places and whole in others.
"""

from __future__ import annotations

from collections.abc import Mapping

from hp_core.planner.structure import ModelStructure, UncoveredParameterError
from hp_core.plans.proposal import propose, yaml_proposal
from hp_core.spec.module_spec import ModuleShardingSpec

__all__ = ["check_unclaimed"]


def check_unclaimed(structure: ModelStructure, modules: Mapping[str, ModuleShardingSpec]) -> None:
    """Raise for parameters no template claimed and no override declared either."""
    if not structure.unclaimed:
        return
    declared: set[str] = set()
    for fqn, spec in modules.items():
        params = spec.params if isinstance(spec.params, dict) else {}
        for rel in params:
            for src in spec._ep_stack.get(rel) or [rel]:
                declared.add(f"{fqn}.{src}" if fqn else src)
    missing = [f for f in structure.unclaimed if f not in declared]
    if not missing:
        return
    lines = "\n".join(
        f"  {f} ({structure.roles[f].value}, shape {structure.unclaimed[f][1]})"
        for f in missing[:10]
    )
    more = f"\n  ... and {len(missing) - 10} more" if len(missing) > 10 else ""
    owners: dict[str, list[str]] = {}
    for f in missing:
        mod = structure.unclaimed[f][0]
        owners.setdefault(mod, []).append(f[len(mod) + 1 :] if mod else f)
    entries = "".join(
        f"  - match: {mod!r}\n    is_boundary: false\n    params: {{"
        + ", ".join(f"{rel}: {{tp: replicate}}" for rel in rels)
        + "}\n"
        for mod, rels in owners.items()
    )
    why = "".join(f"\n({note})" for note in structure.notes)
    raise propose(
        UncoveredParameterError(
            "no boundary template claims these parameters, so hp cannot know their layout:\n"
            f"{lines}{more}{why}\n"
            "Declare them in an override (kept whole, their modules' forwards not wrapped, or in "
            "a boundary that gives their layout), or register a RoleRule (or a ModuleRule) for "
            "your architecture through a plugin (docs/plugins.md)."
        ),
        yaml_proposal(entries, f"keeping {', '.join(missing[:3])} whole on tp"),
    )
