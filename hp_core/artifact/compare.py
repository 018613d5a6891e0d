"""Plan equality as an artifact sees it: ``rebuild(freeze(p))`` is the same plan as ``p``.

Dataclass ``==`` on plans also compares the exempt fields (planner metadata, runtime
introspection) that an artifact does not carry, so it is the wrong question after a
rebuild. Here two plans are the same when their plan-level fields, their module order
and every frozen field of every module are equal, where

- a value that its row's write condition would not write equals "unset" (for example
  ``out_names=[]`` and ``None``, or ``_ep_size=0``): freeze writes neither, so the
  artifact cannot tell them apart, and neither can the applier;
- a decorated callable equals the Target ``{_target_: "module.qualname"}`` that names it;
- maps compare as maps: their key order is not part of a plan's meaning (an artifact
  sorts keys; freeze refuses a spec whose output order would depend on it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hp_core.artifact.freeze import FreezeError, callable_target
from hp_core.injection import Target
from hp_core.plans.model import ShardingPlan
from hp_core.spec.fields import FROZEN_FIELDS, SpecField

__all__ = ["plan_differences", "same_plan"]

_UNSET = "<unset>"
_PLAN_FIELDS = tuple(
    f.name for f in dataclasses.fields(ShardingPlan) if f.compare and f.name != "modules"
)


def _canonical(row: SpecField, value: Any) -> Any:
    if not row.should_write(value):
        return _UNSET
    if callable(value):
        try:
            return Target(callable_target(value, row.name))
        except FreezeError:
            return value
    return value


def plan_differences(a: ShardingPlan, b: ShardingPlan) -> list[str]:
    """Every difference between ``a`` and ``b`` in what an artifact carries (none: same plan)."""
    diffs = [
        f"{name}: {getattr(a, name)!r} != {getattr(b, name)!r}"
        for name in _PLAN_FIELDS
        if getattr(a, name) != getattr(b, name)
    ]
    only_a = [fqn for fqn in a if fqn not in b]
    only_b = [fqn for fqn in b if fqn not in a]
    if only_a or only_b:
        diffs.append(f"modules: only in the first {only_a}, only in the second {only_b}")
    elif list(a) != list(b):
        diffs.append("modules: the same modules in a different order")
    for fqn, spec in a.items():
        if fqn not in b:
            continue
        for row in FROZEN_FIELDS:
            mine, theirs = (_canonical(row, getattr(s, row.name)) for s in (spec, b[fqn]))
            if mine != theirs:
                diffs.append(f"modules[{fqn!r}].{row.name}: {mine!r} != {theirs!r}")
    return diffs


def same_plan(a: ShardingPlan, b: ShardingPlan) -> bool:
    """Whether ``a`` and ``b`` are the same plan for an artifact (see the module docstring)."""
    return not plan_differences(a, b)
