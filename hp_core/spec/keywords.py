"""Typo-checked keyword arguments: suggest the closest valid name instead of a bare TypeError."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Iterable, Sequence
from typing import Any

from hp_core.errors import HpError

__all__ = ["UnknownFieldError", "close_matches", "closest", "did_you_mean", "keyword_checked"]


def close_matches(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """The closest valid names to a typo, best first (may be empty)."""
    return difflib.get_close_matches(str(name), sorted(set(map(str, candidates))), n=n, cutoff=0.5)


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The closest valid name to a typo, or None."""
    best = close_matches(name, candidates, n=1)
    return best[0] if best else None


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """' Did you mean X?' for the closest candidate, or an empty string."""
    best = closest(name, candidates)
    return f" Did you mean {best!r}?" if best else ""


class UnknownFieldError(HpError, TypeError):
    """A constructor got a keyword argument that is none of its fields (usually a typo)."""


def _unknown_field_message(
    cls_name: str, key: str, fields: Sequence[str], internal: Sequence[str]
) -> str:
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
    ``@dataclasses.dataclass``. Names in the class's ``__hp_internal__`` (attributes hp
    sets itself) are refused as internal, like fields with ``init=False``.
    """
    fields = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    internal = (
        *(f.name for f in dataclasses.fields(cls) if not f.init),
        *getattr(cls, "__hp_internal__", ()),
    )
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
