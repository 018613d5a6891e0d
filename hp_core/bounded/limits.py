"""hp's input limits: the caps, where they come from, the error a refusal raises.

The caps (bytes, nesting depth, expanded YAML nodes) come from a keyword argument, else
an environment variable, else a default (:class:`InputLimits`). :class:`InputLimitError`
is what every refusal raises; :func:`check_size` and :func:`read_bounded` apply the size
cap. The helpers that word a refusal (:func:`refusal`, :func:`format_path`, ...) are
shared by the JSON and YAML readers beside this module.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from hp_core.errors import HpError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_NODES",
    "ENV_MAX_BYTES",
    "ENV_MAX_DEPTH",
    "ENV_MAX_NODES",
    "InputLimitError",
    "InputLimits",
    "check_size",
    "error_class",
    "format_path",
    "line_col",
    "located",
    "raise_hint",
    "read_bounded",
    "refusal",
    "too_deep_for_python",
]

#: Default cap on a document's size in bytes (8 MiB).
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
#: Default cap on a document's nesting depth (lists and mappings inside each other).
DEFAULT_MAX_DEPTH = 64
#: Default cap on a YAML document's node count with every alias expanded.
DEFAULT_MAX_NODES = 100_000

ENV_MAX_BYTES = "HP_MAX_INPUT_BYTES"
ENV_MAX_DEPTH = "HP_MAX_INPUT_DEPTH"
ENV_MAX_NODES = "HP_MAX_YAML_NODES"

_PATH_PARTS_SHOWN = 8
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class InputLimitError(HpError, ValueError):
    """A document over one of hp's input limits (size, depth, YAML alias expansion) or
    holding a value hp refuses to read (a non-finite or overlong JSON number).

    ``source`` is the file (or ``<string>``), ``path`` the place inside the document
    (``None`` when unknown), ``limit`` the cap that was hit and ``env`` the environment
    variable that raises it (``None`` for refusals no limit allows).
    """

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        path: str | None = None,
        limit: int | None = None,
        env: str | None = None,
    ) -> None:
        super().__init__(message)
        self.source = source
        self.path = path
        self.limit = limit
        self.env = env


def error_class(error: type[InputLimitError] | None) -> type[InputLimitError]:
    """The class a refusal raises: ``error``, which must derive from :class:`InputLimitError`
    (default: :class:`InputLimitError` itself)."""
    if error is None:
        return InputLimitError
    if not (isinstance(error, type) and issubclass(error, InputLimitError)):
        raise TypeError(
            f"error: expected a subclass of InputLimitError, got {error!r}. Declare one that also "
            "derives from your own error class, e.g. "
            "class PlanYAMLInputLimitError(PlanYAMLError, InputLimitError)."
        )
    return error


def refusal(
    cls: type[InputLimitError],
    message: str,
    *,
    source: str | None,
    path: str | None = None,
    limit: int | None = None,
    env: str | None = None,
) -> InputLimitError:
    """A ``cls`` refusal carrying ``source``, ``path``, ``limit`` and ``env`` (to be raised)."""
    error = cls(message)  # a base class may have its own __init__: set the fields afterwards
    error.source, error.path, error.limit, error.env = source, path, limit, env
    return error


def too_deep_for_python(
    cls: type[InputLimitError], source: str, limits: InputLimits
) -> InputLimitError:
    """A raised depth limit that the interpreter's own stack cannot hold."""
    return refusal(
        cls,
        f"{source}: nesting too deep for Python's parser; {ENV_MAX_DEPTH}={limits.max_depth} "
        f"is more than the interpreter's stack allows. Lower {ENV_MAX_DEPTH} "
        f"(the default is {DEFAULT_MAX_DEPTH}).",
        source=source,
        limit=limits.max_depth,
        env=ENV_MAX_DEPTH,
    )


# ------------------------------------------------------------------ the limits


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what}: expected a positive integer, got {value!r}.")
    return value


def _from_env(env: str, default: int, error: type[InputLimitError]) -> int:
    raw = os.environ.get(env)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw.strip().replace("_", ""))
    except ValueError:
        value = 0
    if value < 1:
        raise refusal(
            error,
            f"{env}={raw!r}: expected a positive integer; unset it to use the default {default}.",
            source=None,
            env=env,
        )
    return value


@dataclasses.dataclass(frozen=True)
class InputLimits:
    """The caps one read applies (see :meth:`current`)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_depth: int = DEFAULT_MAX_DEPTH
    max_nodes: int = DEFAULT_MAX_NODES

    @classmethod
    def current(
        cls,
        *,
        max_bytes: int | None = None,
        max_depth: int | None = None,
        max_nodes: int | None = None,
        error: type[InputLimitError] | None = None,
    ) -> InputLimits:
        """Each cap from its keyword argument, else its environment variable, else its default.

        A malformed environment value raises ``error`` (default :class:`InputLimitError`).
        """
        err = error_class(error)
        return cls(
            max_bytes=_positive(max_bytes, "max_bytes")
            if max_bytes is not None
            else _from_env(ENV_MAX_BYTES, DEFAULT_MAX_BYTES, err),
            max_depth=_positive(max_depth, "max_depth")
            if max_depth is not None
            else _from_env(ENV_MAX_DEPTH, DEFAULT_MAX_DEPTH, err),
            max_nodes=_positive(max_nodes, "max_nodes")
            if max_nodes is not None
            else _from_env(ENV_MAX_NODES, DEFAULT_MAX_NODES, err),
        )


def raise_hint(env: str, at_least: int) -> str:
    """The sentence that ends a refusal a limit allows: which variable to raise, and to what."""
    return f"If the document is legitimate, raise the limit: {env}={at_least}."


def format_path(parts: list[Any]) -> str:
    """A path inside a document (keys and indexes) as ``a.b[3]['x y']``, cut after 8 parts."""
    out = ""
    for i, part in enumerate(parts):
        if i == _PATH_PARTS_SHOWN:
            return out + "..."
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and _IDENT.fullmatch(part):
            out += f".{part}" if out else part
        else:
            out += f"[{part!r}]"
    return out


def located(source: str, path: str | None) -> str:
    """``source: path``, or ``source`` alone when the path is unknown or empty."""
    return f"{source}: {path}" if path else source


def line_col(text: str, offset: int) -> str:
    """``line L, column C`` (both from 1) of ``offset`` in ``text``."""
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return f"line {line}, column {column}"


def check_size(
    data: str | bytes,
    *,
    source: str = "<input>",
    max_bytes: int | None = None,
    error: type[InputLimitError] | None = None,
) -> None:
    """Refuse ``data`` if it is over ``max_bytes`` (UTF-8 bytes for text)."""
    cls = error_class(error)
    limit = InputLimits.current(max_bytes=max_bytes, error=cls).max_bytes
    if isinstance(data, str):
        if len(data) * 4 <= limit:  # no character is more than 4 UTF-8 bytes
            return
        size = len(data.encode("utf-8", "replace"))
    else:
        size = len(data)
    if size > limit:
        raise _size_error(cls, source, size, limit)


def _size_error(
    cls: type[InputLimitError], source: str, size: int | None, limit: int
) -> InputLimitError:
    got = f"{size} bytes" if size is not None else "more bytes"
    return refusal(
        cls,
        f"{source}: {got}, over the input limit of {limit} bytes; hp refuses larger documents. "
        + raise_hint(ENV_MAX_BYTES, size if size is not None else 2 * limit),
        source=source,
        limit=limit,
        env=ENV_MAX_BYTES,
    )


def read_bounded(
    path: str | os.PathLike[str],
    *,
    source: str | None = None,
    max_bytes: int | None = None,
    error: type[InputLimitError] | None = None,
) -> bytes:
    """The bytes of the file at ``path``, refused without reading it all if it is over
    ``max_bytes``. ``OSError`` propagates."""
    name = str(path) if source is None else source
    cls = error_class(error)
    limit = InputLimits.current(max_bytes=max_bytes, error=cls).max_bytes
    with Path(path).open("rb") as f:
        data = f.read(limit + 1)
        if len(data) > limit:
            try:
                size: int | None = os.fstat(f.fileno()).st_size
            except OSError:
                size = None
            if size is not None and size <= limit:  # a growing or special file
                size = None
            raise _size_error(cls, name, size, limit)
    return data
