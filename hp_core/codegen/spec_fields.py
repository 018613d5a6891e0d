"""``SPEC_FIELDS``: the one table that classifies every ``ModuleShardingSpec`` field (SPEC §8).

Freeze and rebuild walk this table and dispatch on its kinds; neither has code for a
particular field. The row order is the key order of a frozen entry. A field is either
frozen (it has a meta key, a group and a freeze and a rebuild kind) or exempt (planner
metadata and runtime introspection that an artifact does not carry).

Columns:

- ``group``: ``param_plan`` (the contract: one rule per module), ``injections`` (custom
  compute: a rule only for modules that have some), or ``exempt``;
- ``freeze_kind`` / ``rebuild_kind``: how a value becomes JSON and back;
- ``post_init``: the planner fills the field after the merge (from the finished spec and
  the model), so no user or template writes it and the dataclass cannot take it as an
  argument; rebuild sets it after construction, like every field the constructor lacks.

Write conditions belong to the freeze kind: ``placement_map``, ``named_placements``,
``attr_list``, ``scalar``, ``value_to_dict`` and ``plain`` write a value that is not None
(so an explicit ``{}`` or ``[]`` survives); ``name_list``, ``dict_copy`` and
``int_truthy`` write a truthy value only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from hp_core.spec.keywords import close_matches
from hp_core.spec.module_spec import ModuleShardingSpec

__all__ = [
    "EXEMPT_FIELDS",
    "FREEZE_KINDS",
    "FROZEN_FIELDS",
    "FROZEN_GROUPS",
    "FROZEN_META_KEYS",
    "GROUPS",
    "INJECTION_FIELDS",
    "MATCH_KEY",
    "PARAM_PLAN_FIELDS",
    "POST_INIT_FIELDS",
    "REBUILD_KINDS",
    "SPEC_FIELDS",
    "SPEC_FIELDS_BY_NAME",
    "WRITE_WHEN",
    "SpecField",
    "fields_in_group",
    "table_problems",
]

PARAM_PLAN = "param_plan"
INJECTIONS = "injections"
EXEMPT = "exempt"
#: Every group, in the order frozen groups appear in a meta.
GROUPS: tuple[str, ...] = (PARAM_PLAN, INJECTIONS, EXEMPT)
#: Groups that an artifact carries (each is a list of ``{match, ...}`` rules in a meta).
FROZEN_GROUPS: tuple[str, ...] = (PARAM_PLAN, INJECTIONS)
#: The key of a rule that names its module (so no field may use it as its meta key).
MATCH_KEY = "match"

#: Freeze kind → when a value is written: ``"not_none"`` or ``"truthy"``.
WRITE_WHEN: Mapping[str, str] = MappingProxyType(
    {
        "placement_map": "not_none",
        "named_placements": "not_none",
        "attr_list": "not_none",
        "scalar": "not_none",
        "value_to_dict": "not_none",
        "plain": "not_none",
        "name_list": "truthy",
        "dict_copy": "truthy",
        "int_truthy": "truthy",
    }
)
FREEZE_KINDS: tuple[str, ...] = tuple(WRITE_WHEN)
REBUILD_KINDS: tuple[str, ...] = (
    "placement_map",
    "named_placements",
    "name_list",
    "attr_list",
    "bool_default_true",
    "opt_scalar",
    "tuple_empty",
    "injection_target",
    "dict_copy",
    "int_truthy",
)


@dataclasses.dataclass(frozen=True)
class SpecField:
    """One row of :data:`SPEC_FIELDS`: how one dataclass field is frozen and rebuilt."""

    field: str
    meta_key: str | None
    group: str
    freeze_kind: str | None
    rebuild_kind: str | None
    post_init: bool = False

    def __post_init__(self) -> None:
        row = f"SpecField({self.field!r})"
        if self.group not in GROUPS:
            raise ValueError(f"{row}: unknown group {self.group!r}; groups are {', '.join(GROUPS)}.")
        classified = (self.meta_key, self.freeze_kind, self.rebuild_kind)
        if self.exempt:
            if classified != (None, None, None) or self.post_init:
                raise ValueError(
                    f"{row}: an exempt field is not frozen, so it has no meta key, kinds or post_init."
                )
            return
        if not self.meta_key or self.meta_key == MATCH_KEY:
            raise ValueError(
                f"{row}: a frozen field needs a meta key other than {MATCH_KEY!r}, got {self.meta_key!r}."
            )
        if self.freeze_kind not in FREEZE_KINDS:
            raise ValueError(
                f"{row}: unknown freeze kind {self.freeze_kind!r}; kinds are {', '.join(FREEZE_KINDS)}."
            )
        if self.rebuild_kind not in REBUILD_KINDS:
            raise ValueError(
                f"{row}: unknown rebuild kind {self.rebuild_kind!r}; kinds are {', '.join(REBUILD_KINDS)}."
            )

    @property
    def exempt(self) -> bool:
        return self.group == EXEMPT

    def should_write(self, value: Any) -> bool:
        """The write condition of this row's freeze kind (False for exempt rows)."""
        if self.exempt:
            return False
        if WRITE_WHEN[str(self.freeze_kind)] == "truthy":
            return bool(value)
        return value is not None


def _row(field: str, meta_key: str, group: str, freeze: str, rebuild: str, post_init: bool = False) -> SpecField:
    return SpecField(field, meta_key, group, freeze, rebuild, post_init)


def _exempt(field: str) -> SpecField:
    return SpecField(field, None, EXEMPT, None, None)


#: SPEC §8, row by row and in this order.
SPEC_FIELDS: tuple[SpecField, ...] = (
    _row("params", "params", PARAM_PLAN, "placement_map", "placement_map"),
    _row("in_src", "in_src", PARAM_PLAN, "named_placements", "named_placements"),
    _row("in_dst", "in_dst", PARAM_PLAN, "named_placements", "named_placements"),
    _row("out_src", "out_src", PARAM_PLAN, "named_placements", "named_placements"),
    _row("out_dst", "out_dst", PARAM_PLAN, "named_placements", "named_placements"),
    _row("out_names", "out_names", PARAM_PLAN, "name_list", "name_list"),
    _row("tp_divide_attrs", "tp_divide_attrs", PARAM_PLAN, "attr_list", "attr_list"),
    _row("is_boundary", "is_boundary", PARAM_PLAN, "scalar", "bool_default_true"),
    _row("region_dispatch", "region_dispatch", PARAM_PLAN, "scalar", "opt_scalar"),
    _row("_deferred_bias_params", "deferred_bias_params", PARAM_PLAN, "name_list", "tuple_empty", post_init=True),
    _row("skip_source_lowering", "skip_source_lowering", PARAM_PLAN, "int_truthy", "opt_scalar"),
    _row("inner_wrapper", "inner_wrapper", INJECTIONS, "value_to_dict", "injection_target"),
    _row("inner_target", "inner_target", INJECTIONS, "plain", "opt_scalar"),
    _row("inner_out_src", "inner_out_src", INJECTIONS, "value_to_dict", "injection_target"),
    _row("local_compute_fn", "local_compute_fn", INJECTIONS, "value_to_dict", "injection_target"),
    _row("_ep_stack", "ep_stack", INJECTIONS, "dict_copy", "dict_copy"),
    _row("_ep_size", "ep_size", INJECTIONS, "int_truthy", "int_truthy"),
    _exempt("_tp_local_attr_plan"),
    _exempt("_is_terminal"),
    _exempt("_needs_cp_attn"),
    _exempt("_resolved_inner_wrapper"),
    _exempt("_resolved_inner_target"),
)


def _check_unique(rows: Iterable[SpecField]) -> None:
    """Field names and meta keys must each be unique across the table."""
    seen_fields: set[str] = set()
    seen_keys: set[str] = set()
    for row in rows:
        if row.field in seen_fields:
            raise ValueError(f"SPEC_FIELDS: field {row.field!r} has more than one row.")
        seen_fields.add(row.field)
        if row.meta_key is not None:
            if row.meta_key in seen_keys:
                raise ValueError(f"SPEC_FIELDS: meta key {row.meta_key!r} is used by more than one row.")
            seen_keys.add(row.meta_key)


_check_unique(SPEC_FIELDS)

#: Row by dataclass field name.
SPEC_FIELDS_BY_NAME: Mapping[str, SpecField] = MappingProxyType({r.field: r for r in SPEC_FIELDS})
#: Rows an artifact carries, in table order.
FROZEN_FIELDS: tuple[SpecField, ...] = tuple(r for r in SPEC_FIELDS if not r.exempt)
#: Rows an artifact leaves out.
EXEMPT_FIELDS: tuple[SpecField, ...] = tuple(r for r in SPEC_FIELDS if r.exempt)
#: Every meta key a frozen entry may hold (besides ``match``).
FROZEN_META_KEYS: frozenset[str] = frozenset(str(r.meta_key) for r in FROZEN_FIELDS)
#: Rows the planner fills after the merge.
POST_INIT_FIELDS: tuple[SpecField, ...] = tuple(r for r in SPEC_FIELDS if r.post_init)


def fields_in_group(group: str) -> tuple[SpecField, ...]:
    """The rows of ``group`` in table order; an unknown group is a ``ValueError``."""
    if group not in GROUPS:
        best = close_matches(group, GROUPS, n=1)
        hint = f" Did you mean {best[0]!r}?" if best else ""
        raise ValueError(f"unknown SPEC_FIELDS group {group!r}.{hint} Groups: {', '.join(GROUPS)}.")
    return tuple(r for r in SPEC_FIELDS if r.group == group)


#: The contract rows (one rule per module in a meta).
PARAM_PLAN_FIELDS: tuple[SpecField, ...] = fields_in_group(PARAM_PLAN)
#: The custom-compute rows (a rule only where a module has some).
INJECTION_FIELDS: tuple[SpecField, ...] = fields_in_group(INJECTIONS)


def table_problems(
    cls: type = ModuleShardingSpec, rows: Iterable[SpecField] = SPEC_FIELDS
) -> list[str]:
    """What keeps ``rows`` from classifying ``cls`` exactly (empty when the table is complete).

    A dataclass field without a row, a row naming a field the dataclass lacks, and a
    ``post_init`` row for a field the constructor takes are each one problem.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    by_name = {r.field: r for r in rows}
    problems = [
        f"{cls.__name__}.{name} has no row in SPEC_FIELDS: classify it (a frozen group with its "
        "meta key and kinds, or exempt) in hp_core/codegen/spec_fields.py"
        for name in fields
        if name not in by_name
    ]
    problems += [
        f"SPEC_FIELDS row {name!r} names no field of {cls.__name__}: remove the row or fix its name"
        for name in by_name
        if name not in fields
    ]
    problems += [
        f"SPEC_FIELDS row {name!r} is post_init but {cls.__name__}.{name} is a constructor argument"
        for name, row in by_name.items()
        if row.post_init and name in fields and fields[name].init
    ]
    return problems
