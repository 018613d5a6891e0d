"""The spec model: mesh axes, placements and their DSL, the per-boundary contract.

Everything here is plain data plus pure functions. Nothing touches a model or a
process group, so plans can be built, merged and compared anywhere.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any, Union

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from hp_core.errors import HpError

__all__ = [
    "AUTO",
    "CANONICAL_AXES",
    "CONTRACT_FIELDS",
    "CP",
    "DP",
    "EP",
    "NONE",
    "TP",
    "IncompleteContractError",
    "MeshAxisName",
    "ModuleShardingSpec",
    "NamedPlacement",
    "PlacementMismatchError",
    "PlacementSyntaxError",
    "SpecValidationError",
    "UnknownFieldError",
    "UnsupportedPartialError",
    "check_lowerable",
    "close_matches",
    "finalize_insert",
    "format_named_placement",
    "format_placement",
    "keyword_checked",
    "merge_specs",
    "parse_named_placement",
    "parse_placement",
    "resolve_placements",
]


# --------------------------------------------------------------------------- axes


class MeshAxisName(StrEnum):
    """Canonical mesh axis names. Members compare and hash equal to plain strings."""

    tp = "tp"
    cp = "cp"
    ep = "ep"
    pp = "pp"
    dp = "dp"
    dp_replicate = "dp_replicate"
    dp_shard = "dp_shard"
    dp_cp = "dp_cp"
    ep_shard = "ep_shard"
    # Upper-case aliases: ``MeshAxisName.TP is MeshAxisName.tp``.
    TP = "tp"
    CP = "cp"
    EP = "ep"
    DP = "dp"


TP = MeshAxisName.TP
CP = MeshAxisName.CP
EP = MeshAxisName.EP
DP = MeshAxisName.DP

#: Every canonical axis name, as plain strings.
CANONICAL_AXES: frozenset[str] = frozenset(m.value for m in MeshAxisName)

#: A layout per mesh axis: ``{"tp": Shard(1), "cp": Shard(1)}``. The key is a mesh
#: axis; the ``N`` in ``Shard(N)`` is a tensor dimension.
NamedPlacement = dict[str, Placement]


def close_matches(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """The closest valid names to a typo, best first (may be empty)."""
    return difflib.get_close_matches(str(name), sorted(set(map(str, candidates))), n=n, cutoff=0.5)


def _did_you_mean(name: str, candidates: Iterable[str]) -> str:
    best = close_matches(name, candidates, n=1)
    return f" Did you mean {best[0]!r}?" if best else ""


# ------------------------------------------------------- keyword-checked dataclasses


class UnknownFieldError(HpError, TypeError):
    """A constructor got a keyword argument that is none of its fields (usually a typo)."""


def _unknown_field_message(cls_name: str, key: str, fields: Sequence[str], internal: Sequence[str]) -> str:
    valid = ", ".join(fields) or "none"
    if key in internal:
        return (
            f"{cls_name}({key}=...): {key!r} is an internal field that hp sets itself; it is not a "
            f"constructor argument. Remove it. The fields you may pass are: {valid}."
        )
    best = close_matches(key, fields, n=1)
    hint = f" Did you mean {best[0]!r}?" if best else ""
    fix = f"rename it to {best[0]!r}" if best else "use one of the fields above"
    return f"{cls_name}({key}=...): unknown field {key!r}.{hint} Fields: {valid}. Fix: {fix}."


def keyword_checked(cls: Any) -> Any:
    """Make a dataclass refuse unknown keyword arguments with :class:`UnknownFieldError`.

    The dataclass's own ``TypeError`` ("unexpected keyword argument") names the typo but
    not the field that was meant; this one suggests the closest field. Apply it above
    ``@dataclasses.dataclass``.
    """
    fields = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    internal = tuple(f.name for f in dataclasses.fields(cls) if not f.init)
    known = frozenset(fields)
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs and not known.issuperset(kwargs):
            key = next(k for k in kwargs if k not in known)
            raise UnknownFieldError(_unknown_field_message(cls.__name__, key, fields, internal))
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def resolve_placements(named: Mapping[str, Placement], mesh_dim_names: Sequence[str]) -> list[Placement]:
    """Turn a named layout into torch's positional list: mesh order, missing axes replicated."""
    dims = [str(d) for d in mesh_dim_names]
    for axis in named:
        if str(axis) not in dims:
            raise SpecValidationError(
                f"placement axis {str(axis)!r} is not a dimension of the mesh {tuple(dims)}."
                f"{_did_you_mean(axis, dims)} Use one of the mesh's dimension names."
            )
    by_name = {str(k): v for k, v in named.items()}
    return [by_name.get(d, Replicate()) for d in dims]


# ------------------------------------------------------------------ placement DSL

PLACEMENT_GRAMMAR = "replicate | partial | shard(N)  (N a non-negative integer; case and spaces ignored)"

# ASCII only: in Unicode mode ``\d`` matches the digits of every script (Arabic-Indic
# U+0661 in ``shard(...)``) and IGNORECASE folds letters such as U+017F (long s) or the
# Kelvin sign into ASCII ones.
_DSL = re.compile(
    r"^\s*(?:(replicate)|(partial)(?:\s*\(\s*([A-Za-z_]+)\s*\))?|shard\s*\(\s*([0-9]+)\s*\))\s*$",
    re.IGNORECASE | re.ASCII,
)


class PlacementSyntaxError(HpError, ValueError):
    """A placement string (or axis mapping) that does not follow the DSL."""


class SpecValidationError(HpError, ValueError):
    """A ModuleShardingSpec field holds a value of the wrong shape."""


class IncompleteContractError(HpError, ValueError):
    """An inserted boundary (no derived boundary to merge into) lacks part of its contract."""


class UnsupportedPartialError(PlacementSyntaxError, SpecValidationError):
    """A partial placement hp cannot lower: a reduce op other than sum, or a Partial subclass."""


_PARTIAL_FIX = (
    "hp lowers only sum partials: write 'partial' (or 'partial(sum)') in YAML and Partial() "
    "(reduce_op 'sum') in Python, and compute a partial sum in the module if the reduction "
    "is something else."
)


def check_lowerable(p: Placement, *, path: str = "placement", module: str | None = None) -> Placement:
    """``p`` itself, or :class:`UnsupportedPartialError` for a partial hp cannot lower.

    DTensor's ``Partial`` carries a reduce op (``Partial("max")``, ``"avg"``, ...), and
    private subclasses (the masked partial of a vocab-parallel lookup) carry state that a
    user spec cannot provide. hp's boundaries lower a partial as a sum, so only a plain
    ``Partial()`` with reduce op ``sum`` may appear in a spec.
    """
    if isinstance(p, Partial) and (type(p) is not Partial or p.reduce_op != "sum"):
        where = f" (module {module!r})" if module is not None else ""
        what = (
            f"Partial({p.reduce_op!r})"
            if type(p) is Partial
            else f"{type(p).__name__} (a Partial subclass, reduce op {getattr(p, 'reduce_op', '?')!r})"
        )
        raise UnsupportedPartialError(f"{path}{where}: {what} is not supported; only partial(sum) is. {_PARTIAL_FIX}")
    return p


def _non_ascii_digits(text: str) -> tuple[str, str | None] | None:
    """``(the non-ASCII digits of text, text with them made ASCII)``, or None when it has none.

    The ASCII spelling is None when a digit has no decimal value (a superscript '²').
    """
    digits = "".join(ch for ch in text if not ch.isascii() and ch.isdigit())
    if not digits:
        return None
    if any(unicodedata.decimal(ch, None) is None for ch in digits):
        return digits, None
    return digits, "".join(str(unicodedata.decimal(ch)) if ch in digits else ch for ch in text)


def parse_placement(raw: str | Placement, *, path: str = "placement") -> Placement:
    """Parse ``replicate`` | ``partial`` | ``shard(N)``; a Placement passes through.

    ``N`` is ASCII digits only; ``partial(sum)`` is accepted as a spelling of ``partial``,
    and any other ``partial(op)`` is refused (:class:`UnsupportedPartialError`).
    """
    if isinstance(raw, Placement):
        return raw
    if not isinstance(raw, str):
        raise PlacementSyntaxError(
            f"{path}: expected a placement string, got {type(raw).__name__} {raw!r}. "
            f"Grammar: {PLACEMENT_GRAMMAR}."
        )
    m = _DSL.match(raw)
    if m is None:
        found = _non_ascii_digits(raw)
        if found is not None:
            digits, ascii_text = found
            fix = f"Write {ascii_text!r}." if ascii_text is not None else "Write the dimension with 0-9."
            raise PlacementSyntaxError(
                f"{path}: {raw!r} is not a placement: {digits!r} {'is not an ASCII digit' if len(digits) == 1 else 'are not ASCII digits'}, "
                f"and placements take the digits 0-9 only. {fix} Grammar: {PLACEMENT_GRAMMAR}."
            )
        raise PlacementSyntaxError(
            f"{path}: {raw!r} is not a placement. Grammar: {PLACEMENT_GRAMMAR}. "
            "Example: 'shard(1)'."
        )
    if m.group(1):
        return Replicate()
    if m.group(2):
        op = m.group(3)
        if op is not None and op.lower() != "sum":
            raise UnsupportedPartialError(
                f"{path}: {raw!r}: partial({op}) is not supported; only partial(sum) is. {_PARTIAL_FIX} "
                f"Grammar: {PLACEMENT_GRAMMAR}."
            )
        return Partial()
    dim = int(m.group(4))
    if dim > 64:  # torch refuses dims past a C int; no tensor has this many dimensions anyway
        raise PlacementSyntaxError(f"{path}: {raw!r}: dimension {dim} is out of range; a tensor dimension is a small number (0, 1, ...).")
    return Shard(dim)


def format_placement(p: Placement) -> str:
    """The DSL text of a placement (inverse of :func:`parse_placement`)."""
    if type(p) is Shard:
        return f"shard({p.dim})"
    if isinstance(p, Replicate):
        return "replicate"
    if isinstance(p, Partial) and p.reduce_op == "sum":
        return "partial"
    raise PlacementSyntaxError(
        f"placement {p!r} has no DSL form; the grammar is {PLACEMENT_GRAMMAR}."
    )


def parse_named_placement(raw: Any, *, path: str = "placement") -> NamedPlacement:
    """Parse a non-empty ``{axis: DSL string}`` mapping into ``{axis: Placement}``.

    Custom axis names are legal here; they are checked against the mesh at plan time.
    """
    if not isinstance(raw, Mapping) or not raw:
        raise PlacementSyntaxError(
            f"{path}: expected a non-empty mapping of mesh axis to placement, "
            f"e.g. {{tp: shard(1)}}, got {raw!r}. Placement grammar: {PLACEMENT_GRAMMAR}."
        )
    out: NamedPlacement = {}
    for axis, text in raw.items():
        if not isinstance(axis, str) or not axis.strip():
            raise PlacementSyntaxError(
                f"{path}: mesh axis names must be non-empty strings, got {axis!r}."
            )
        key = str(axis).strip()
        out[key] = parse_placement(text, path=f"{path}.{key}")
    return out


def format_named_placement(named: Mapping[str, Placement]) -> dict[str, str]:
    """``{axis: Placement}`` → ``{axis: DSL text}``; inverse of :func:`parse_named_placement`."""
    return {str(axis): format_placement(p) for axis, p in named.items()}


# ------------------------------------------------------------------------ the spec

AUTO = "auto"
NONE = "none"
_SENTINELS = (AUTO, NONE)

#: Contract fields follow "unset inherits, set wins" (SPEC 2.3).
CONTRACT_FIELDS = ("params", "in_src", "in_dst", "out_src", "out_dst", "out_names", "tp_divide_attrs")
#: Injection-like fields win whenever the override sets them (not None).
_WIN_WHEN_SET = (
    "skip_source_lowering",
    "region_dispatch",
    "inner_target",
    "inner_wrapper",
    "inner_out_src",
    "local_compute_fn",
)

PlacementMap = dict[str, NamedPlacement]
Injection = Union[str, Callable[..., Any], Any]  # registry name, decorated callable or Target


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
            raise SpecValidationError(f"{path}: mesh axis names must be non-empty strings, got {axis!r}.")
        try:
            out[str(axis)] = check_lowerable(parse_placement(p, path=f"{path}.{axis}"), path=f"{path}.{axis}")
        except UnsupportedPartialError:
            raise
        except PlacementSyntaxError as e:
            raise SpecValidationError(str(e)) from None
    return out


def _norm_map(raw: Any, path: str) -> PlacementMap:
    if not isinstance(raw, Mapping):
        raise SpecValidationError(
            f"{path}: expected a mapping of name to {{axis: placement}}, or 'auto'/'none', got {raw!r}."
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
            raise SpecValidationError(f"{path}: every entry must be a non-empty string, got {item!r}.")
    return list(raw)


def _check_injection(raw: Any, path: str) -> Any:
    from hp_core.injection import Target  # local: injection imports spec

    if isinstance(raw, (str, Target)) or callable(raw):
        if isinstance(raw, str) and not raw:
            raise SpecValidationError(f"{path}: an empty string names no registry item.")
        return raw
    raise SpecValidationError(
        f"{path}: expected a registry name, a decorated function or a Target, got {raw!r}."
    )


@keyword_checked
@dataclasses.dataclass
class ModuleShardingSpec:
    """The contract of one module boundary (SPEC 2.2).

    ``None`` in a contract field means "not declared": on merge it inherits the derived
    value. Explicit values, including ``{}``, replace the whole field.
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

    # Internal: written by the planner / applier, never by users.
    _tp_local_attr_plan: dict[str, tuple[int, int]] | None = dataclasses.field(default=None, init=False, repr=False)
    _deferred_bias_params: tuple[str, ...] = dataclasses.field(default=(), init=False, repr=False)
    _is_terminal: bool = dataclasses.field(default=False, init=False, repr=False)
    _needs_cp_attn: bool = dataclasses.field(default=False, init=False, repr=False)
    _resolved_inner_wrapper: Any = dataclasses.field(default=None, init=False, repr=False)
    _resolved_inner_target: str | None = dataclasses.field(default=None, init=False, repr=False)
    _ep_stack: dict[str, list[str]] = dataclasses.field(default_factory=dict, init=False, repr=False)
    _ep_size: int = dataclasses.field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        cls = "ModuleShardingSpec"
        for name in CONTRACT_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            path = f"{cls}.{name}"
            if isinstance(value, str):
                if value not in _SENTINELS:
                    raise SpecValidationError(
                        f"{path}: the only string values are the sentinels 'auto' (inherit) "
                        f"and 'none' (clear), got {value!r}."
                    )
                continue
            if name in ("params", "in_src", "in_dst"):
                value = _norm_map(value, path)
            elif name in ("out_src", "out_dst"):
                value = _norm_out(value, path)
            else:
                value = _norm_names(value, path)
            setattr(self, name, value)
        for name in ("is_boundary",):
            if not isinstance(getattr(self, name), bool):
                raise SpecValidationError(f"{cls}.{name}: expected True or False, got {getattr(self, name)!r}.")
        for name in ("skip_source_lowering", "region_dispatch"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise SpecValidationError(f"{cls}.{name}: expected True, False or None, got {value!r}.")
        if self.inner_target is not None and (not isinstance(self.inner_target, str) or not self.inner_target):
            raise SpecValidationError(
                f"{cls}.inner_target: expected 'self' or a child attribute name, got {self.inner_target!r}."
            )
        for name in ("inner_wrapper", "local_compute_fn"):
            value = getattr(self, name)
            if value is not None:
                _check_injection(value, f"{cls}.{name}")
        if self.inner_out_src is not None and self.inner_out_src != "first_input":
            if isinstance(self.inner_out_src, str):
                raise SpecValidationError(
                    f"{cls}.inner_out_src: the only string value is 'first_input', got {self.inner_out_src!r}."
                )
            self.inner_out_src = _norm_out(self.inner_out_src, f"{cls}.inner_out_src")

    # Convenience views ------------------------------------------------------
    @property
    def has_injection(self) -> bool:
        return self.inner_wrapper is not None or self.local_compute_fn is not None

    def output_names(self) -> list[str]:
        """Declared output order: ``out_names``, else key order of ``out_src``."""
        if isinstance(self.out_names, list):
            return list(self.out_names)
        if isinstance(self.out_src, dict):
            return list(self.out_src)
        return []


# ------------------------------------------------------------------------- merge


def _clear_value(name: str) -> Any:
    if name in ("params", "in_src", "in_dst"):
        return {}
    if name == "tp_divide_attrs":
        return []
    return None


def _copy_value(v: Any) -> Any:
    from hp_core.injection import Target  # local: injection imports spec

    if isinstance(v, Target):
        return Target(v.target, dict(v.config))
    if isinstance(v, dict):
        return {k: (dict(x) if isinstance(x, dict) else x) for k, x in v.items()}
    if isinstance(v, list):
        return list(v)
    return v


def _copy_internals(src: ModuleShardingSpec, dst: ModuleShardingSpec) -> None:
    for f in dataclasses.fields(ModuleShardingSpec):
        if not f.init:
            setattr(dst, f.name, _copy_value(getattr(src, f.name)))


def merge_specs(
    derived: ModuleShardingSpec, override: ModuleShardingSpec, *, fqn: str = "<module>"
) -> tuple[ModuleShardingSpec, list[str]]:
    """Merge a user override into a derived spec: "unset inherits, set wins" (SPEC 2.3).

    Returns a new spec and a list of notes naming what the override dropped. Neither
    input is mutated.
    """
    notes: list[str] = []
    kwargs: dict[str, Any] = {}
    for name in CONTRACT_FIELDS:
        mine, theirs = getattr(override, name), getattr(derived, name)
        if mine is None or mine == AUTO:
            kwargs[name] = _copy_value(theirs if theirs not in _SENTINELS else None)
        elif mine == NONE:
            kwargs[name] = _clear_value(name)
            if theirs:
                notes.append(f"{fqn}.{name}: cleared by 'none' (derived value {theirs!r} dropped)")
        else:
            kwargs[name] = _copy_value(mine)
            if isinstance(theirs, dict) and isinstance(mine, dict):
                dropped = [k for k in theirs if k not in mine]
                if dropped:
                    notes.append(f"{fqn}.{name}: override replaces the whole field; dropped keys {dropped}")
            elif isinstance(theirs, list) and theirs != mine:
                notes.append(f"{fqn}.{name}: override replaces {theirs!r} with {mine!r}")
    kwargs["is_boundary"] = derived.is_boundary and override.is_boundary
    for name in _WIN_WHEN_SET:
        mine = getattr(override, name)
        kwargs[name] = _copy_value(mine if mine is not None else getattr(derived, name))
    merged = ModuleShardingSpec(**kwargs)
    _copy_internals(derived, merged)
    return merged, notes


_REQUIRED_FOR_INSERT = ("params", "in_src", "in_dst", "out_src", "out_dst")


def finalize_insert(override: ModuleShardingSpec, *, fqn: str) -> ModuleShardingSpec:
    """Validate and normalize an override that creates a new boundary.

    With no derived spec to inherit from, the override must declare its whole contract
    (``params`` only for a non-boundary, which does not wrap forward).
    """
    required = _REQUIRED_FOR_INSERT if override.is_boundary else ("params",)
    missing = [n for n in required if getattr(override, n) in (None, AUTO)]
    if missing:
        example = "\n".join(f"    {n}: {{x: {{tp: replicate}}}}" if n != "params" else f"    {n}: {{}}" for n in missing)
        raise IncompleteContractError(
            f"override for {fqn!r} inserts a new boundary (the planner derived none there), "
            f"so it must declare its full contract; missing: {', '.join(missing)}. "
            f"Declare them, or use 'none' for an empty one, e.g.\n  - match: {fqn!r}\n{example}"
        )
    blank = ModuleShardingSpec()
    merged, _ = merge_specs(blank, override, fqn=fqn)
    for name in ("params", "in_src", "in_dst"):
        if getattr(merged, name) is None:
            setattr(merged, name, {})
    return merged


# ------------------------------------------------------------------------ errors


def _fmt_layout(value: Any) -> str:
    if isinstance(value, Mapping):
        inner = ", ".join(f"{k}: {_fmt_layout(v)}" for k, v in value.items())
        return "{" + inner + "}"
    if isinstance(value, Placement):
        try:
            return format_placement(value)
        except PlacementSyntaxError:
            return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt_layout(v) for v in value) + "]"
    return str(value)


class PlacementMismatchError(HpError, ValueError):
    """DTensor propagation produced a layout that differs from the declared one (validate mode)."""

    STAGES = ("params", "out_src", "out_dst", "inner_out_src")

    def __init__(self, module_name: str, expected: Any, actual: Any, stage: str) -> None:
        base = stage.split("[", 1)[0]
        if base not in self.STAGES:
            raise ValueError(f"unknown PlacementMismatchError stage {stage!r}; expected one of {self.STAGES}")
        self.module_name = module_name
        self.expected = expected
        self.actual = actual
        self.stage = stage
        super().__init__(
            f"{module_name}: {stage} placement mismatch.\n"
            f"  expected (plan): {_fmt_layout(expected)}\n"
            f"  actual (DTensor propagation): {_fmt_layout(actual)}\n"
            f"Fix: declare the actual layout in the override for {module_name!r} "
            f"({base}: ...), or change the computation so it produces the declared one."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.module_name, self.expected, self.actual, self.stage))
