"""Placements and their DSL: ``replicate | partial | shard(N)`` per named mesh axis.

A layout is a :data:`NamedPlacement` (``{"tp": Shard(1)}``); :func:`resolve_placements`
turns it into torch's positional list. Only sum partials can be lowered
(:func:`check_lowerable`). :class:`PlacementMismatchError` reports a layout that differs
from the declared one.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from hp_core.errors import HpError
from hp_core.spec.keywords import did_you_mean

__all__ = [
    "PLACEMENT_GRAMMAR",
    "NamedPlacement",
    "PlacementMismatchError",
    "PlacementSyntaxError",
    "SpecValidationError",
    "UnsupportedPartialError",
    "check_lowerable",
    "format_named_placement",
    "format_placement",
    "parse_named_placement",
    "parse_placement",
    "resolve_placements",
]


#: A layout per mesh axis: ``{"tp": Shard(1), "cp": Shard(1)}``. The key is a mesh
#: axis; the ``N`` in ``Shard(N)`` is a tensor dimension.
NamedPlacement = dict[str, Placement]


PLACEMENT_GRAMMAR = (
    "replicate | partial | shard(N)  (N a non-negative integer; case and spaces ignored)"
)

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


class UnsupportedPartialError(PlacementSyntaxError, SpecValidationError):
    """A partial placement hp cannot lower: a reduce op other than sum, or a Partial subclass."""


_PARTIAL_FIX = (
    "hp lowers only sum partials: write 'partial' (or 'partial(sum)') in YAML and Partial() "
    "(reduce_op 'sum') in Python, and compute a partial sum in the module if the reduction "
    "is something else."
)


def check_lowerable(
    p: Placement, *, path: str = "placement", module: str | None = None
) -> Placement:
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
            else (
                f"{type(p).__name__} (a Partial subclass, reduce op "
                f"{getattr(p, 'reduce_op', '?')!r})"
            )
        )
        raise UnsupportedPartialError(
            f"{path}{where}: {what} is not supported; only partial(sum) is. {_PARTIAL_FIX}"
        )
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
            fix = (
                f"Fix: write {ascii_text!r}."
                if ascii_text is not None
                else "Fix: write the dimension with 0-9."
            )
            raise PlacementSyntaxError(
                f"{path}: {raw!r} is not a placement: {digits!r} "
                f"{'is not an ASCII digit' if len(digits) == 1 else 'are not ASCII digits'}, and "
                f"placements take the digits 0-9 only. {fix} Grammar: {PLACEMENT_GRAMMAR}."
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
                f"{path}: {raw!r}: partial({op}) is not supported; only partial(sum) is. "
                f"{_PARTIAL_FIX} Grammar: {PLACEMENT_GRAMMAR}."
            )
        return Partial()
    dim = int(m.group(4))
    if dim > 64:  # torch refuses dims past a C int; no tensor has this many dimensions anyway
        raise PlacementSyntaxError(
            f"{path}: {raw!r}: dimension {dim} is out of range; a tensor dimension is a small "
            "number (0, 1, ...)."
        )
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


def resolve_placements(
    named: Mapping[str, Placement], mesh_dim_names: Sequence[str]
) -> list[Placement]:
    """Turn a named layout into torch's positional list: mesh order, missing axes replicated."""
    dims = [str(d) for d in mesh_dim_names]
    for axis in named:
        if str(axis) not in dims:
            raise SpecValidationError(
                f"placement axis {str(axis)!r} is not a dimension of the mesh {tuple(dims)}."
                f"{did_you_mean(axis, dims)} Use one of the mesh's dimension names."
            )
    by_name = {str(k): v for k, v in named.items()}
    return [by_name.get(d, Replicate()) for d in dims]


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
            raise ValueError(
                f"unknown PlacementMismatchError stage {stage!r}; expected one of {self.STAGES}"
            )
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
