"""``ModuleShardingSpec``: the contract of one module boundary, validated by its field table.

Plain data: nothing here touches a model or a process group. Every user field is checked
by the value kind its row of :data:`~hp_core.spec.fields.SPEC_FIELDS` gives; the
planner-derived facts sit in one :class:`~hp_core.spec.derived.Derived` record; specs are
copied one way, :func:`copy_spec`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Union

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from hp_core.spec.derived import Derived
from hp_core.spec.fields import (
    DERIVED_FIELDS,
    RUNTIME_FIELDS,
    SENTINELS,
    SPEC_FIELDS_BY_NAME,
    SpecField,
)
from hp_core.spec.keywords import keyword_checked
from hp_core.spec.placements import (
    NamedPlacement,
    PlacementSyntaxError,
    SpecValidationError,
    UnsupportedPartialError,
    check_lowerable,
    parse_placement,
)

__all__ = [
    "Injection",
    "ModuleShardingSpec",
    "PlacementMap",
    "copy_spec",
    "copy_value",
    "is_target",
    "layout_map",
    "spec_field_names",
    "spec_from_checked",
    "table_problems",
]

PlacementMap = dict[str, NamedPlacement]
Injection = Union[str, Callable[..., Any], Any]  # registry name, decorated callable or Target


def is_target(value: Any) -> bool:
    """Whether ``value`` is a :class:`hp_core.injection.Target` (a ``{_target_: ...}`` reference).

    Recognized by its shape (a dataclass with a string ``target`` and a mapping ``config``)
    so that the spec, which injection builds on, does not import injection.
    """
    return (
        dataclasses.is_dataclass(value)
        and not isinstance(value, type)
        and isinstance(getattr(value, "target", None), str)
        and isinstance(getattr(value, "config", None), Mapping)
    )


# ------------------------------------------------------------- the value kinds


def _is_placement_like(v: Any) -> bool:
    return isinstance(v, (Placement, str))


def _norm_named(raw: Any, path: str) -> NamedPlacement:
    """A Python-side NamedPlacement: Placement objects or DSL strings, plain-str axis keys."""
    if not isinstance(raw, Mapping) or not raw:
        raise SpecValidationError(
            f"{path}: expected a non-empty {{axis: placement}} mapping such as "
            f"{{'tp': Shard(1)}}, got {raw!r}."
        )
    out: NamedPlacement = {}
    for axis, p in raw.items():
        if not isinstance(axis, str) or not axis:
            raise SpecValidationError(
                f"{path}: mesh axis names must be non-empty strings, got {axis!r}."
            )
        try:
            out[str(axis)] = check_lowerable(
                parse_placement(p, path=f"{path}.{axis}"), path=f"{path}.{axis}"
            )
        except UnsupportedPartialError:
            raise
        except PlacementSyntaxError as e:
            raise SpecValidationError(str(e)) from None
    return out


def _norm_map(raw: Any, path: str) -> PlacementMap:
    if not isinstance(raw, Mapping):
        raise SpecValidationError(
            f"{path}: expected a mapping of name to {{axis: placement}}, or 'auto'/'none', got "
            f"{raw!r}."
        )
    out: PlacementMap = {}
    for name, named in raw.items():
        if not isinstance(name, str) or not name:
            raise SpecValidationError(f"{path}: keys must be non-empty strings, got {name!r}.")
        out[name] = _norm_named(named, f"{path}.{name}")
    return out


def _norm_out(raw: Any, path: str) -> PlacementMap:
    """Output layouts, with the scalar shorthand ``{tp: ...}`` → ``{"output": {tp: ...}}``."""
    if isinstance(raw, Mapping) and raw and all(_is_placement_like(v) for v in raw.values()):
        return {"output": _norm_named(raw, path)}
    return _norm_map(raw, path)


def _norm_names(raw: Any, path: str) -> list[str]:
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
        raise SpecValidationError(f"{path}: expected a list of names, got {raw!r}.")
    for item in raw:
        if not isinstance(item, str) or not item:
            raise SpecValidationError(
                f"{path}: every entry must be a non-empty string, got {item!r}."
            )
    return list(raw)


def _check_injection(raw: Any, path: str) -> Any:
    if isinstance(raw, str) or is_target(raw) or callable(raw):
        if isinstance(raw, str) and not raw:
            raise SpecValidationError(f"{path}: an empty string names no registry item.")
        return raw
    raise SpecValidationError(
        f"{path}: expected a registry name, a decorated function or a Target, got {raw!r}."
    )


def _sentinel(value: str, path: str) -> str:
    if value not in SENTINELS:
        raise SpecValidationError(
            f"{path}: the only string values are the sentinels 'auto' (inherit) "
            f"and 'none' (clear), got {value!r}."
        )
    return value


def _check_placement_map(value: Any, path: str) -> Any:
    return _sentinel(value, path) if isinstance(value, str) else _norm_map(value, path)


def _check_out_map(value: Any, path: str) -> Any:
    return _sentinel(value, path) if isinstance(value, str) else _norm_out(value, path)


def _check_name_list(value: Any, path: str) -> Any:
    return _sentinel(value, path) if isinstance(value, str) else _norm_names(value, path)


def _check_bool(value: Any, path: str) -> Any:
    if not isinstance(value, bool):
        raise SpecValidationError(f"{path}: expected True or False, got {value!r}.")
    return value


def _check_opt_bool(value: Any, path: str) -> Any:
    if not isinstance(value, bool):
        raise SpecValidationError(f"{path}: expected True, False or None, got {value!r}.")
    return value


def _check_inner_target(value: Any, path: str) -> Any:
    if not isinstance(value, str) or not value:
        raise SpecValidationError(
            f"{path}: expected 'self' or a child attribute name, got {value!r}."
        )
    return value


def _check_inner_out(value: Any, path: str) -> Any:
    if value == "first_input":
        return value
    if isinstance(value, str):
        raise SpecValidationError(f"{path}: the only string value is 'first_input', got {value!r}.")
    return _norm_out(value, path)


#: User value kind → ``(value, path) -> normalized value`` (called for values not None,
#: except ``bool``, which has no None).
CHECKS: Mapping[str, Callable[[Any, str], Any]] = {
    "placement_map": _check_placement_map,
    "out_map": _check_out_map,
    "name_list": _check_name_list,
    "bool": _check_bool,
    "opt_bool": _check_opt_bool,
    "inner_target": _check_inner_target,
    "injection": _check_injection,
    "inner_out": _check_inner_out,
}


# ----------------------------------------------------------------- the spec


def _derived_attribute(row: SpecField) -> property:
    """``spec._<name>``: reads the Derived record; assigning replaces the record's value."""
    name = row.record_name

    def get(self: ModuleShardingSpec) -> Any:
        return getattr(self.derived, name)

    def set_(self: ModuleShardingSpec, value: Any) -> None:
        self.derived = self.derived.replace(**{name: value})

    return property(get, set_, doc=f"``derived.{name}`` (planner-derived; see Derived).")


@keyword_checked
@dataclasses.dataclass
class ModuleShardingSpec:
    """The contract of one module boundary (docs/concepts.md).

    ``None`` in a contract field means "not declared": on merge it inherits the derived
    value. Explicit values, including ``{}``, replace the whole field. ``derived`` holds
    what the planner derived (written by templates through :meth:`with_derived`).
    """

    params: PlacementMap | str | None = None
    in_src: PlacementMap | str | None = None
    in_dst: PlacementMap | str | None = None
    out_src: PlacementMap | str | None = None
    out_dst: PlacementMap | str | None = None
    out_names: list[str] | str | None = None
    tp_divide_attrs: list[str] | str | None = None
    is_boundary: bool = True
    skip_source_lowering: bool | None = None
    region_dispatch: bool | None = None
    inner_target: str | None = None
    inner_wrapper: Injection | None = None
    inner_out_src: str | PlacementMap | None = None
    local_compute_fn: Injection | None = None

    derived: Derived = dataclasses.field(default_factory=Derived, init=False, repr=False)

    # Not plan data: what apply() resolved is introspection of the applied model. These
    # class-level defaults only keep the names readable on a plan's specs.
    _resolved_inner_wrapper: ClassVar[Any] = None
    _resolved_inner_target: ClassVar[str | None] = None
    # Names hp sets itself: refused as constructor arguments (see keyword_checked).
    __hp_internal__: ClassVar[tuple[str, ...]] = (
        *(r.name for r in DERIVED_FIELDS),
        *RUNTIME_FIELDS,
    )

    if TYPE_CHECKING:
        # What mypy sees of the ``spec._<name>`` views that the loop below the class installs
        # from DERIVED_FIELDS (it cannot follow setattr): one per Derived field, same type.
        @property
        def _tp_local_attr_plan(self) -> dict[str, tuple[int, int]] | None: ...
        @_tp_local_attr_plan.setter
        def _tp_local_attr_plan(self, value: dict[str, tuple[int, int]] | None) -> None: ...
        @property
        def _deferred_bias_params(self) -> tuple[str, ...]: ...
        @_deferred_bias_params.setter
        def _deferred_bias_params(self, value: tuple[str, ...]) -> None: ...
        @property
        def _is_terminal(self) -> bool: ...
        @_is_terminal.setter
        def _is_terminal(self, value: bool) -> None: ...
        @property
        def _needs_cp_attn(self) -> bool: ...
        @_needs_cp_attn.setter
        def _needs_cp_attn(self, value: bool) -> None: ...
        @property
        def _ep_stack(self) -> dict[str, list[str]]: ...
        @_ep_stack.setter
        def _ep_stack(self, value: dict[str, list[str]]) -> None: ...
        @property
        def _ep_size(self) -> int: ...
        @_ep_size.setter
        def _ep_size(self, value: int) -> None: ...
        @property
        def _fused_layouts(self) -> dict[str, dict[str, Any]]: ...
        @_fused_layouts.setter
        def _fused_layouts(self, value: dict[str, dict[str, Any]]) -> None: ...

    def __post_init__(self) -> None:
        for name, kind in _CHECKED_FIELDS:
            value = getattr(self, name)
            if value is None and kind != "bool":
                continue
            setattr(self, name, CHECKS[kind](value, f"ModuleShardingSpec.{name}"))

    def with_derived(self, **facts: Any) -> ModuleShardingSpec:
        """Record planner-derived facts (fields of :class:`Derived`) on this spec; returns it."""
        self.derived = self.derived.replace(**facts)
        return self

    # Convenience views ------------------------------------------------------
    @property
    def has_injection(self) -> bool:
        """Whether the spec injects custom compute (an inner wrapper or a local compute)."""
        return self.inner_wrapper is not None or self.local_compute_fn is not None

    def output_names(self) -> list[str]:
        """Declared output order: ``out_names``, else key order of ``out_src``."""
        if isinstance(self.out_names, list):
            return list(self.out_names)
        if isinstance(self.out_src, dict):
            return list(self.out_src)
        return []


# ``spec._tp_local_attr_plan``, ``spec._ep_size``, ...: derived facts (docs/artifacts.md names).
for _row in DERIVED_FIELDS:
    setattr(ModuleShardingSpec, _row.name, _derived_attribute(_row))
del _row

#: The dataclass's fields, and the user fields with a value kind (what ``__post_init__``
#: checks), computed once: building and copying specs is on the planner's hot path.
_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ModuleShardingSpec))
_CHECKED_FIELDS: tuple[tuple[str, str], ...] = tuple(
    (name, row.kind)
    for name in _FIELD_NAMES
    if (row := SPEC_FIELDS_BY_NAME.get(name)) is not None and row.kind is not None
)


def layout_map(value: PlacementMap | str | None) -> PlacementMap:
    """The layouts a planned spec's field holds: its mapping, ``{}`` when it declares none.

    The sentinels ``'auto'``/``'none'`` are words of an override, replaced when it merges
    into a derived spec; code that reads a planned spec's layouts reads them through here,
    so a spec that still holds a sentinel fails with its name instead of on a ``str``.
    """
    if isinstance(value, str):
        raise SpecValidationError(
            f"a layouts field holds the sentinel {value!r}, which only an override may: "
            "plan the model (hp_core.plan) so that overrides merge, or declare the layouts."
        )
    return value or {}


# ------------------------------------------------------------------ copying


def spec_from_checked(values: Mapping[str, Any]) -> ModuleShardingSpec:
    """A spec from user-field values a codec has already parsed and checked (each layout is
    checked once, where it is read); fields not in ``values`` take their defaults."""
    spec = ModuleShardingSpec.__new__(ModuleShardingSpec)
    for f in dataclasses.fields(ModuleShardingSpec):
        if f.name in values:
            value = values[f.name]
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = f.default
        setattr(spec, f.name, value)
    return spec


#: Value types a copy shares (immutable): tested by exact type first, because most values of a
#: planned spec are placements and ``isinstance`` against torch's placement types is slow.
_SHARED_TYPES = frozenset({str, int, float, bool, type(None), Shard, Replicate, Partial})


def copy_value(value: Any) -> Any:
    """A copy of a spec value whose containers (and Targets) are independent of ``value``'s.

    Placements are immutable and callables are shared.
    """
    if type(value) in _SHARED_TYPES:
        return value
    if isinstance(value, dict):
        return {k: copy_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copy_value(v) for v in value]
    if isinstance(value, tuple):
        return tuple(copy_value(v) for v in value)
    if isinstance(value, Derived):
        return value.copy()
    if is_target(value):
        return dataclasses.replace(value, config=copy_value(value.config))
    return value


def copy_spec(spec: ModuleShardingSpec) -> ModuleShardingSpec:
    """The one way to copy a spec: every field (the Derived record included) independent of
    ``spec``'s; attributes the applier set on the instance are shared."""
    new = copy.copy(spec)
    for name in _FIELD_NAMES:
        setattr(new, name, copy_value(getattr(spec, name)))
    return new


# ------------------------------------------------------------- table reflection


def spec_field_names(cls: type = ModuleShardingSpec) -> list[str]:
    """Every name the field table must classify: the dataclass fields (the ``derived``
    holder aside), the Derived record's fields as ``_name``, and runtime names."""
    names = [f.name for f in dataclasses.fields(cls) if f.name != "derived"]
    names += [f"_{f.name}" for f in dataclasses.fields(Derived)]
    for klass in reversed(cls.__mro__):
        for name, hint in vars(klass).get("__annotations__", {}).items():
            if str(hint).startswith("ClassVar") and not name.startswith("__") and name not in names:
                names.append(name)
    return names


def table_problems(
    cls: type = ModuleShardingSpec, rows: Sequence[SpecField] | None = None
) -> list[str]:
    """What keeps ``rows`` (default: SPEC_FIELDS) from classifying ``cls`` exactly (empty
    when the table is complete).

    A field without a row, a row naming a field the spec lacks, and a ``post_init`` row for
    a field the constructor takes are each one problem.
    """
    rows = tuple(SPEC_FIELDS_BY_NAME.values()) if rows is None else tuple(rows)
    names = spec_field_names(cls)
    init = {f.name for f in dataclasses.fields(cls) if f.init}
    by_name = {r.name: r for r in rows}
    problems = [
        f"{cls.__name__}.{name} has no row in SPEC_FIELDS: classify it (a frozen group with its "
        "meta key and kinds, or exempt) in hp_core/spec/fields.py"
        for name in names
        if name not in by_name
    ]
    problems += [
        f"SPEC_FIELDS row {name!r} names no field of {cls.__name__}: remove the row or fix its name"
        for name in by_name
        if name not in names
    ]
    problems += [
        f"SPEC_FIELDS row {name!r} is post_init but {cls.__name__}.{name} is a constructor argument"
        for name, row in by_name.items()
        if row.post_init and name in init
    ]
    return problems
