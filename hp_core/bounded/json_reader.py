"""``loads_json``: ``json.loads`` under hp's size and depth caps, refusing non-finite numbers."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from hp_core.bounded.limits import (
    ENV_MAX_DEPTH,
    InputLimitError,
    InputLimits,
    check_size,
    error_class,
    format_path,
    line_col,
    located,
    raise_hint,
    refusal,
    too_deep_for_python,
)

__all__ = ["loads_json"]

_JSON_DEPTH_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_JSON_PATH_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},]', re.DOTALL)


def _json_too_deep(text: str, limit: int) -> int | None:
    """The offset of the first bracket that opens a container past ``limit`` (None: none).
    Linear; brackets inside strings do not count."""
    if text.count("[") + text.count("{") <= limit:
        return None
    depth = 0
    for m in _JSON_DEPTH_TOKENS.finditer(text):
        c = text[m.start()]
        if c == "[" or c == "{":
            depth += 1
            if depth > limit:
                return m.start()
        elif c == "]" or c == "}":
            depth -= 1
    return None


def _json_path_at(text: str, offset: int) -> list[Any]:
    """The key path of the value that starts at ``offset`` (keys and indexes, outermost first)."""
    stack: list[list[Any]] = []  # [bracket, key or index, expecting a key]
    for m in _JSON_PATH_TOKENS.finditer(text, 0, offset):
        c = text[m.start()]
        if c == '"':
            if stack and stack[-1][0] == "{" and stack[-1][2]:
                try:
                    stack[-1][1] = json.loads(m.group())
                except ValueError:
                    stack[-1][1] = m.group()
                stack[-1][2] = False
        elif c == "{":
            stack.append(["{", None, True])
        elif c == "[":
            stack.append(["[", 0, False])
        elif c == "]" or c == "}":
            if stack:
                stack.pop()
        elif c == "," and stack:
            if stack[-1][0] == "[":
                stack[-1][1] += 1
            else:
                stack[-1][2] = True
    return [frame[1] for frame in stack if frame[1] is not None]


class _Refused:
    """A number ``loads_json`` will refuse, kept in place until its path is known."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def _find_refused(doc: Any) -> tuple[list[Any], _Refused] | None:
    """The path and marker of the first refused number in document order."""
    stack: list[tuple[list[Any], Any]] = [([], doc)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _Refused):
            return path, value
        if isinstance(value, Mapping):
            stack.extend(([*path, k], v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend(([*path, i], v) for i, v in reversed(list(enumerate(value))))
    return None


def loads_json(
    data: str | bytes,
    *,
    source: str = "<json>",
    max_bytes: int | None = None,
    max_depth: int | None = None,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
    error: type[InputLimitError] | None = None,
) -> Any:
    """``json.loads`` under the size and depth caps, refusing non-finite numbers.

    Bytes must be UTF-8 (``UnicodeDecodeError`` propagates, as does
    ``json.JSONDecodeError`` for text that is not JSON). The depth is checked by a linear
    scan before the parser runs. ``NaN``, ``Infinity``, ``-Infinity``, a float that
    overflows to infinity and an integer too long for Python are refused with the key
    path where they stand. Refusals raise ``error`` (default :class:`InputLimitError`).
    """
    cls = error_class(error)
    limits = InputLimits.current(max_bytes=max_bytes, max_depth=max_depth, error=cls)
    check_size(data, source=source, max_bytes=limits.max_bytes, error=cls)
    text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    offset = _json_too_deep(text, limits.max_depth)
    if offset is not None:
        path = format_path(_json_path_at(text, offset))
        raise refusal(
            cls,
            f"{located(source, path)}: nesting depth over {limits.max_depth} "
            f"({line_col(text, offset)}); "
            f"hp refuses deeper documents. {raise_hint(ENV_MAX_DEPTH, 2 * limits.max_depth)}",
            source=source,
            path=path or None,
            limit=limits.max_depth,
            env=ENV_MAX_DEPTH,
        )
    refused: list[_Refused] = []

    def constant(name: str) -> Any:
        refused.append(_Refused(f"{name} is not a number hp accepts (JSON has no NaN or Infinity)"))
        return refused[-1]

    def parse_float(token: str) -> Any:
        value = float(token)
        if math.isinf(value):
            why = f"{token} overflows to infinity; hp accepts only finite numbers"
            refused.append(_Refused(why))
            return refused[-1]
        return value

    def parse_int(token: str) -> Any:
        try:
            return int(token)
        except ValueError:  # over sys.get_int_max_str_digits()
            digits = len(token.lstrip("-"))
            refused.append(_Refused(f"an integer of {digits} digits is too long to read"))
            return refused[-1]

    try:
        doc = json.loads(
            text,
            object_pairs_hook=object_pairs_hook,
            parse_constant=constant,
            parse_float=parse_float,
            parse_int=parse_int,
        )
    except RecursionError:
        raise too_deep_for_python(cls, source, limits) from None
    if refused:
        found = _find_refused(doc)
        at, marker = ([], refused[0]) if found is None else (found[0], found[1])
        where = format_path(at)
        message = f"{located(source, where)}: {marker.why}."
        raise refusal(cls, message, source=source, path=where or None)
    return doc
