"""The merge rule: a user override into a derived spec, "unset inherits, set wins" (docs/plans.md).

Each field merges by the ``merge`` column of its row in
:data:`~hp_core.spec.fields.SPEC_FIELDS`; planner-derived facts come from the derived spec.
"""

from __future__ import annotations

from typing import Any

from hp_core.errors import HpError
from hp_core.spec.fields import AUTO, NONE, SENTINELS, SPEC_FIELDS, SpecField
from hp_core.spec.module_spec import ModuleShardingSpec, copy_value

__all__ = ["IncompleteContractError", "finalize_insert", "merge_specs"]


class IncompleteContractError(HpError, ValueError):
    """An inserted boundary (no derived boundary to merge into) lacks part of its contract."""


_USER_ROWS: tuple[SpecField, ...] = tuple(r for r in SPEC_FIELDS if r.source == "user")
_CLEARED: dict[str | None, Any] = {"dict": dict, "list": list, None: lambda: None}
#: Fields an inserted boundary must declare (its layouts): params, in_src/dst, out_src/dst.
_REQUIRED_FOR_INSERT = tuple(r.name for r in _USER_ROWS if r.kind in ("placement_map", "out_map"))
#: Fields an inserted boundary that leaves them unset gets empty.
_EMPTY_WHEN_INSERTED = tuple(r.name for r in _USER_ROWS if r.clear == "dict")


def _merge_contract(
    name: str, mine: Any, theirs: Any, clear: str | None, fqn: str, notes: list[str]
) -> Any:
    if mine is None or mine == AUTO:
        return copy_value(theirs if theirs not in SENTINELS else None)
    if mine == NONE:
        if theirs:
            notes.append(f"{fqn}.{name}: cleared by 'none' (derived value {theirs!r} dropped)")
        return _CLEARED[clear]()
    if isinstance(theirs, dict) and isinstance(mine, dict):
        dropped = [k for k in theirs if k not in mine]
        if dropped:
            notes.append(f"{fqn}.{name}: override replaces the whole field; dropped keys {dropped}")
    elif isinstance(theirs, list) and theirs != mine:
        notes.append(f"{fqn}.{name}: override replaces {theirs!r} with {mine!r}")
    return copy_value(mine)


def merge_specs(
    derived: ModuleShardingSpec, override: ModuleShardingSpec, *, fqn: str = "<module>"
) -> tuple[ModuleShardingSpec, list[str]]:
    """Merge a user override into a derived spec: "unset inherits, set wins" (docs/plans.md).

    Returns a new spec and a list of notes naming what the override dropped. Neither
    input is mutated.
    """
    notes: list[str] = []
    kwargs: dict[str, Any] = {}
    for row in _USER_ROWS:
        mine, theirs = getattr(override, row.name), getattr(derived, row.name)
        if row.merge == "contract":
            kwargs[row.name] = _merge_contract(row.name, mine, theirs, row.clear, fqn, notes)
        elif row.merge == "both":
            kwargs[row.name] = theirs and mine
        else:  # win_when_set
            kwargs[row.name] = copy_value(mine if mine is not None else theirs)
    merged = ModuleShardingSpec(**kwargs)
    merged.derived = derived.derived.copy()
    return merged, notes


def finalize_insert(override: ModuleShardingSpec, *, fqn: str) -> ModuleShardingSpec:
    """Validate and normalize an override that creates a new boundary.

    With no derived spec to inherit from, the override must declare its whole contract
    (``params`` only for a non-boundary, which does not wrap forward).
    """
    required = _REQUIRED_FOR_INSERT if override.is_boundary else ("params",)
    missing = [n for n in required if getattr(override, n) in (None, AUTO)]
    if missing:
        example = "\n".join(
            f"    {n}: {{x: {{tp: replicate}}}}" if n != "params" else f"    {n}: {{}}"
            for n in missing
        )
        raise IncompleteContractError(
            f"override for {fqn!r} inserts a new boundary (the planner derived none there), "
            f"so it must declare its full contract; missing: {', '.join(missing)}. "
            f"Declare them, or use 'none' for an empty one, e.g.\n  - match: {fqn!r}\n{example}"
        )
    merged, _ = merge_specs(ModuleShardingSpec(), override, fqn=fqn)
    for name in _EMPTY_WHEN_INSERTED:
        if getattr(merged, name) is None:
            setattr(merged, name, {})
    return merged
