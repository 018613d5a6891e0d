"""``SPEC_FIELDS``: the one table that classifies every ``ModuleShardingSpec`` field.

Every other classification is derived from it: the dataclass's validation and merge rule
(:mod:`hp_core.spec.module_spec`, :mod:`hp_core.spec.merge`), the plan document's YAML
codec (:mod:`hp_core.plans.spec_codec`) and freeze/rebuild (:mod:`hp_core.artifact`). The
first six columns are the table in docs/artifacts.md (upstream hyper-parallel's names)
and their row order is the key order of a frozen entry:

- ``name``: the attribute (a leading underscore marks a planner-derived or runtime one);
- ``key``: its key in a frozen artifact (None for exempt rows);
- ``group``: ``param_plan`` (the contract: one rule per module), ``injections`` (custom
  compute: a rule only for modules that have some), or ``exempt`` (not frozen);
- ``freeze`` / ``rebuild``: how a value becomes JSON and back;
- ``post_init``: the planner fills the field after the merge, from the finished spec and
  the model; rebuild sets it after construction.

The other columns drive the spec and its plan document:

- ``source``: ``user`` (a constructor argument), ``derived`` (written by templates and the
  planner into the spec's :class:`~hp_core.spec.derived.Derived` record; a plan document
  holds it under ``_internal:``) or ``runtime`` (introspection the applier records on the
  applied model; never part of a plan);
- ``kind``: the value kind of a user field, which selects its validation and its YAML form;
- ``merge``: how an override merges into a derived spec (``contract``: unset inherits, set
  wins, ``'none'`` clears; ``win_when_set``: the override wins when not None; ``both``: true
  only when both are true); derived fields always come from the derived spec;
- ``override``: whether a user override may set it;
- ``clear``: what ``'none'`` clears a contract field to (``dict``, ``list`` or None);
- ``example``: a YAML example of the value, for error messages.

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

__all__ = [
    "AUTO",
    "CONTRACT_FIELDS",
    "DERIVED_FIELDS",
    "EXEMPT_FIELDS",
    "FREEZE_KINDS",
    "FROZEN_FIELDS",
    "FROZEN_GROUPS",
    "FROZEN_META_KEYS",
    "GROUPS",
    "INJECTION_FIELDS",
    "LAYOUT_FIELDS",
    "MATCH_KEY",
    "NONE",
    "PARAM_PLAN",
    "PARAM_PLAN_FIELDS",
    "POST_INIT_FIELDS",
    "REBUILD_KINDS",
    "RUNTIME_FIELDS",
    "SENTINELS",
    "SPEC_FIELDS",
    "SPEC_FIELDS_BY_NAME",
    "USER_KINDS",
    "WIN_WHEN_SET_FIELDS",
    "WRITE_WHEN",
    "SpecField",
    "fields_in_group",
]

#: Override sentinels of a contract field: inherit the derived value / clear it.
AUTO = "auto"
NONE = "none"
SENTINELS = (AUTO, NONE)

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
#: Value kinds of user fields (validation in the dataclass, the form in a plan document).
USER_KINDS: tuple[str, ...] = (
    "placement_map",  # {name: {axis: placement}}, or 'auto' / 'none'
    "out_map",  # like placement_map, with the shorthand {axis: placement} for one output
    "name_list",  # [name, ...], or 'auto' / 'none'
    "bool",
    "opt_bool",
    "inner_target",  # 'self' or a child attribute name
    "injection",  # a registry name, a decorated function or a Target
    "inner_out",  # 'first_input' or an out_map without sentinels
)
SOURCES = ("user", "derived", "runtime")
MERGES = ("contract", "win_when_set", "both")


@dataclasses.dataclass(frozen=True)
class SpecField:
    """One row of :data:`SPEC_FIELDS`: how one field is validated, merged, written and frozen."""

    name: str
    key: str | None
    group: str
    freeze: str | None
    rebuild: str | None
    post_init: bool = False
    source: str = dataclasses.field(default="user", kw_only=True)
    kind: str | None = dataclasses.field(default=None, kw_only=True)
    merge: str | None = dataclasses.field(default=None, kw_only=True)
    override: bool = dataclasses.field(default=True, kw_only=True)
    clear: str | None = dataclasses.field(default=None, kw_only=True)
    example: str | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        row = f"SpecField({self.name!r})"
        if self.group not in GROUPS:
            raise ValueError(
                f"{row}: unknown group {self.group!r}; groups are {', '.join(GROUPS)}."
            )
        if self.source not in SOURCES or (self.merge is not None and self.merge not in MERGES):
            raise ValueError(f"{row}: unknown source {self.source!r} or merge {self.merge!r}.")
        if self.kind is not None and self.kind not in USER_KINDS:
            raise ValueError(
                f"{row}: unknown kind {self.kind!r}; kinds are {', '.join(USER_KINDS)}."
            )
        classified = (self.key, self.freeze, self.rebuild)
        if self.exempt:
            if classified != (None, None, None) or self.post_init:
                raise ValueError(
                    f"{row}: an exempt field is not frozen, so it has no meta key, kinds or "
                    "post_init."
                )
            return
        if not self.key or self.key == MATCH_KEY:
            raise ValueError(
                f"{row}: a frozen field needs a meta key other than {MATCH_KEY!r}, got "
                f"{self.key!r}."
            )
        if self.freeze not in FREEZE_KINDS:
            raise ValueError(
                f"{row}: unknown freeze kind {self.freeze!r}; kinds are {', '.join(FREEZE_KINDS)}."
            )
        if self.rebuild not in REBUILD_KINDS:
            raise ValueError(
                f"{row}: unknown rebuild kind {self.rebuild!r}; kinds are "
                f"{', '.join(REBUILD_KINDS)}."
            )

    @property
    def exempt(self) -> bool:
        """Whether an artifact leaves this field out."""
        return self.group == EXEMPT

    @property
    def record_name(self) -> str:
        """The field's name in the :class:`~hp_core.spec.derived.Derived` record and under a
        plan document's ``_internal:`` (the name without its leading underscore)."""
        return self.name.lstrip("_")

    def should_write(self, value: Any) -> bool:
        """The write condition of this row's freeze kind (False for exempt rows)."""
        if self.exempt:
            return False
        if WRITE_WHEN[str(self.freeze)] == "truthy":
            return bool(value)
        return value is not None


def _user(
    name: str, group: str, freeze: str, rebuild: str, kind: str, merge: str, **extra: Any
) -> SpecField:
    return SpecField(name, name, group, freeze, rebuild, kind=kind, merge=merge, **extra)


def _derived(
    name: str,
    key: str | None,
    group: str,
    freeze: str | None,
    rebuild: str | None,
    post_init: bool = False,
) -> SpecField:
    return SpecField(name, key, group, freeze, rebuild, post_init, source="derived")


_PM, _NP, _OV = "placement_map", "named_placements", "contract"

#: The table in docs/artifacts.md, row by row and in this order.
SPEC_FIELDS: tuple[SpecField, ...] = (
    _user(
        "params",
        PARAM_PLAN,
        _PM,
        _PM,
        _PM,
        _OV,
        clear="dict",
        example="{q_proj.weight: {tp: shard(0)}}",
    ),
    _user(
        "in_src",
        PARAM_PLAN,
        _NP,
        _NP,
        _PM,
        _OV,
        clear="dict",
        example="{hidden_states: {tp: shard(1)}}",
    ),
    _user(
        "in_dst",
        PARAM_PLAN,
        _NP,
        _NP,
        _PM,
        _OV,
        clear="dict",
        example="{hidden_states: {tp: replicate}}",
    ),
    _user("out_src", PARAM_PLAN, _NP, _NP, "out_map", _OV, example="{output: {tp: partial}}"),
    _user("out_dst", PARAM_PLAN, _NP, _NP, "out_map", _OV, example="{output: {tp: shard(1)}}"),
    _user("out_names", PARAM_PLAN, "name_list", "name_list", "name_list", _OV),
    _user("tp_divide_attrs", PARAM_PLAN, "attr_list", "attr_list", "name_list", _OV, clear="list"),
    _user("is_boundary", PARAM_PLAN, "scalar", "bool_default_true", "bool", "both"),
    _user("region_dispatch", PARAM_PLAN, "scalar", "opt_scalar", "opt_bool", "win_when_set"),
    _derived(
        "_deferred_bias_params",
        "deferred_bias_params",
        PARAM_PLAN,
        "name_list",
        "tuple_empty",
        post_init=True,
    ),
    # set by codegen (hp freeze) only, so an override may not set it
    _user(
        "skip_source_lowering",
        PARAM_PLAN,
        "int_truthy",
        "opt_scalar",
        "opt_bool",
        "win_when_set",
        override=False,
    ),
    _user(
        "inner_wrapper",
        INJECTIONS,
        "value_to_dict",
        "injection_target",
        "injection",
        "win_when_set",
    ),
    _user("inner_target", INJECTIONS, "plain", "opt_scalar", "inner_target", "win_when_set"),
    _user(
        "inner_out_src",
        INJECTIONS,
        "value_to_dict",
        "injection_target",
        "inner_out",
        "win_when_set",
        example="{tp: shard(1)}",
    ),
    _user(
        "local_compute_fn",
        INJECTIONS,
        "value_to_dict",
        "injection_target",
        "injection",
        "win_when_set",
    ),
    _derived("_ep_stack", "ep_stack", INJECTIONS, "dict_copy", "dict_copy"),
    _derived("_ep_size", "ep_size", INJECTIONS, "int_truthy", "int_truthy"),
    _derived("_fused_layouts", "fused_layouts", INJECTIONS, "dict_copy", "dict_copy"),
    _derived("_tp_local_attr_plan", None, EXEMPT, None, None),
    _derived("_is_terminal", None, EXEMPT, None, None),
    _derived("_needs_cp_attn", None, EXEMPT, None, None),
    SpecField("_resolved_inner_wrapper", None, EXEMPT, None, None, source="runtime"),
    SpecField("_resolved_inner_target", None, EXEMPT, None, None, source="runtime"),
)


def _check_unique(rows: Iterable[SpecField]) -> None:
    """Field names and meta keys must each be unique across the table."""
    seen_fields: set[str] = set()
    seen_keys: set[str] = set()
    for row in rows:
        if row.name in seen_fields:
            raise ValueError(f"SPEC_FIELDS: field {row.name!r} has more than one row.")
        seen_fields.add(row.name)
        if row.key is not None:
            if row.key in seen_keys:
                raise ValueError(f"SPEC_FIELDS: meta key {row.key!r} is used by more than one row.")
            seen_keys.add(row.key)


_check_unique(SPEC_FIELDS)

#: Row by field name.
SPEC_FIELDS_BY_NAME: Mapping[str, SpecField] = MappingProxyType({r.name: r for r in SPEC_FIELDS})
#: Rows an artifact carries, in table order.
FROZEN_FIELDS: tuple[SpecField, ...] = tuple(r for r in SPEC_FIELDS if not r.exempt)
#: Rows an artifact leaves out.
EXEMPT_FIELDS: tuple[SpecField, ...] = tuple(r for r in SPEC_FIELDS if r.exempt)
#: Every meta key a frozen entry may hold (besides ``match``).
FROZEN_META_KEYS: frozenset[str] = frozenset(str(r.key) for r in FROZEN_FIELDS)
#: Rows the planner fills after the merge.
POST_INIT_FIELDS: tuple[SpecField, ...] = tuple(r for r in SPEC_FIELDS if r.post_init)
#: Planner-derived rows (held by the spec's Derived record).
DERIVED_FIELDS: tuple[SpecField, ...] = tuple(r for r in SPEC_FIELDS if r.source == "derived")
#: Names of runtime introspection: recorded on the applied model, never part of a plan.
RUNTIME_FIELDS: tuple[str, ...] = tuple(r.name for r in SPEC_FIELDS if r.source == "runtime")
#: Contract fields: "unset inherits, set wins", in table order.
CONTRACT_FIELDS: tuple[str, ...] = tuple(r.name for r in SPEC_FIELDS if r.merge == "contract")
#: Fields an override wins whenever it sets them (not None).
WIN_WHEN_SET_FIELDS: tuple[str, ...] = tuple(
    r.name for r in SPEC_FIELDS if r.merge == "win_when_set"
)
#: Fields that hold layouts (``{name: {axis: placement}}``) once a spec is normalized.
LAYOUT_FIELDS: tuple[str, ...] = tuple(
    r.name for r in SPEC_FIELDS if r.kind in ("placement_map", "out_map", "inner_out")
)


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
