"""Readers that refuse oversized or hostile documents.

hp reads YAML plans and overrides, JSON artifacts, verifier reports and HF config files
that users (or anyone who can write those files) hand it. These readers put caps on
what a document may cost before it becomes Python data:

* its size in bytes (``HP_MAX_INPUT_BYTES``, default 8 MiB);
* its nesting depth (``HP_MAX_INPUT_DEPTH``, default 64), checked before the parser
  recurses, so a 100,000-deep document is refused instead of raising ``RecursionError``;
* for YAML, the number of nodes the document holds once every alias is expanded
  (``HP_MAX_YAML_NODES``, default 100,000), so a "billion laughs" alias bomb is refused
  while it is being read instead of exhausting memory later, and a recursive alias is
  refused outright;
* for JSON, numbers that are not finite (``NaN``, ``Infinity``, ``-Infinity``, ``1e999``)
  and integers too long for Python to read.

Each refusal raises :class:`InputLimitError`, or the subclass of it a caller passes as
``error=`` (one that also derives from the caller's own error class, such as
``PlanYAMLInputLimitError``, so that ``except PlanYAMLError`` catches it too), with a
message naming the source, the path inside the document where it is known, the limit,
and the environment variable that raises it::

    plan.yaml: overrides[3].config: nesting depth over 64 (line 12, column 17); hp refuses
    deeper documents. If the document is legitimate, raise the limit: HP_MAX_INPUT_DEPTH=128.

A keyword argument (``max_bytes=``, ``max_depth=``, ``max_nodes=``) overrides the
environment variable, which overrides the default. The environment is read at each call;
a malformed value there (``HP_MAX_INPUT_DEPTH=lots``) raises the same ``error=`` class.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

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
    "load_yaml",
    "loads_json",
    "read_bounded",
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


def _error_class(error: type[InputLimitError] | None) -> type[InputLimitError]:
    """The class a refusal raises: ``error``, which must derive from :class:`InputLimitError`
    (default: :class:`InputLimitError` itself)."""
    if error is None:
        return InputLimitError
    if not (isinstance(error, type) and issubclass(error, InputLimitError)):
        raise TypeError(
            f"error: expected a subclass of InputLimitError, got {error!r}. Declare one that also derives "
            "from your own error class, e.g. class PlanYAMLInputLimitError(PlanYAMLError, InputLimitError)."
        )
    return error


def _refuse(
    cls: type[InputLimitError],
    message: str,
    *,
    source: str | None,
    path: str | None = None,
    limit: int | None = None,
    env: str | None = None,
) -> InputLimitError:
    error = cls(message)  # a base class may have its own __init__: set the fields afterwards
    error.source, error.path, error.limit, error.env = source, path, limit, env
    return error


def _too_deep_for_python(cls: type[InputLimitError], source: str, limits: InputLimits) -> InputLimitError:
    """A raised depth limit that the interpreter's own stack cannot hold."""
    return _refuse(
        cls,
        f"{source}: nesting too deep for Python's parser; {ENV_MAX_DEPTH}={limits.max_depth} is more "
        f"than the interpreter's stack allows. Lower {ENV_MAX_DEPTH} (the default is {DEFAULT_MAX_DEPTH}).",
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
        raise _refuse(
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
        err = _error_class(error)
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


def _raise_hint(env: str, at_least: int) -> str:
    return f"If the document is legitimate, raise the limit: {env}={at_least}."


def _format_path(parts: list[Any]) -> str:
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


def _where(source: str, path: str | None) -> str:
    return f"{source}: {path}" if path else source


def _line_col(text: str, offset: int) -> str:
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
    cls = _error_class(error)
    limit = InputLimits.current(max_bytes=max_bytes, error=cls).max_bytes
    if isinstance(data, str):
        if len(data) * 4 <= limit:  # no character is more than 4 UTF-8 bytes
            return
        size = len(data.encode("utf-8", "replace"))
    else:
        size = len(data)
    if size > limit:
        raise _size_error(cls, source, size, limit)


def _size_error(cls: type[InputLimitError], source: str, size: int | None, limit: int) -> InputLimitError:
    got = f"{size} bytes" if size is not None else "more bytes"
    return _refuse(
        cls,
        f"{source}: {got}, over the input limit of {limit} bytes; hp refuses larger documents. "
        + _raise_hint(ENV_MAX_BYTES, size if size is not None else 2 * limit),
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
    cls = _error_class(error)
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


# ------------------------------------------------------------------------ JSON

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
    cls = _error_class(error)
    limits = InputLimits.current(max_bytes=max_bytes, max_depth=max_depth, error=cls)
    check_size(data, source=source, max_bytes=limits.max_bytes, error=cls)
    text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    offset = _json_too_deep(text, limits.max_depth)
    if offset is not None:
        path = _format_path(_json_path_at(text, offset))
        raise _refuse(
            cls,
            f"{_where(source, path)}: nesting depth over {limits.max_depth} ({_line_col(text, offset)}); "
            f"hp refuses deeper documents. {_raise_hint(ENV_MAX_DEPTH, 2 * limits.max_depth)}",
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
            refused.append(_Refused(f"{token} overflows to infinity; hp accepts only finite numbers"))
            return refused[-1]
        return value

    def parse_int(token: str) -> Any:
        try:
            return int(token)
        except ValueError:  # over sys.get_int_max_str_digits()
            refused.append(_Refused(f"an integer of {len(token.lstrip('-'))} digits is too long to read"))
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
        raise _too_deep_for_python(cls, source, limits) from None
    if refused:
        found = _find_refused(doc)
        path, marker = ([], refused[0]) if found is None else (found[0], found[1])
        where = _format_path(path)
        raise _refuse(cls, f"{_where(source, where)}: {marker.why}.", source=source, path=where or None)
    return doc


# ------------------------------------------------------------------------ YAML

_KEY = object()  # the path element while a mapping key is being composed


class _BoundedComposer:
    """Loader mixin: caps depth and expanded node count while the document is composed.

    PyYAML's composer recurses once per nesting level and shares, rather than copies,
    aliased nodes; the cost of an alias is the node count of what it names, so counting
    that size per anchor keeps the check linear in the text.
    """

    anchors: dict[str, yaml.Node]
    check_event: Callable[..., bool]
    peek_event: Callable[[], yaml.Event]

    def _hp_setup(self, limits: InputLimits, source: str, error: type[InputLimitError]) -> None:
        self._hp_limits = limits
        self._hp_source = source
        self._hp_error = error
        self._hp_path: list[Any] = []
        self._hp_depth = 0
        self._hp_total = 0
        self._hp_sizes: dict[str, int] = {}
        self._hp_open: set[str] = set()

    def _hp_refuse(self, what: str, mark: Any, *, limit: int | None, env: str | None, fix: str) -> InputLimitError:
        path = _format_path([p for p in self._hp_path if p is not _KEY])
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        return _refuse(
            self._hp_error,
            f"{_where(self._hp_source, path)}: {what}{at}; {fix}",
            source=self._hp_source,
            path=path or None,
            limit=limit,
            env=env,
        )

    def _hp_count(self, nodes: int, event: yaml.Event, alias: str | None) -> None:
        self._hp_total += nodes
        limit = self._hp_limits.max_nodes
        if self._hp_total > limit:
            detail = f": alias *{alias} repeats {nodes} nodes" if alias is not None else ""
            raise self._hp_refuse(
                f"the document expands to over {limit} nodes{detail}",
                event.start_mark,
                limit=limit,
                env=ENV_MAX_NODES,
                fix="hp refuses it (YAML aliases that expand like this are an alias bomb, and no plan "
                f"needs that many nodes). {_raise_hint(ENV_MAX_NODES, 10 * limit)}",
            )

    def compose_document(self) -> Any:
        self._hp_sizes = {}
        self._hp_open = set()
        return super().compose_document()  # type: ignore[misc]

    def compose_node(self, parent: Any, index: Any) -> Any:
        pushed = parent is not None
        if pushed:
            if isinstance(index, int):
                self._hp_path.append(index)
            elif isinstance(index, yaml.ScalarNode):
                self._hp_path.append(index.value)
            else:
                self._hp_path.append(_KEY)  # a key, or the value of a non-scalar key
        try:
            return self._hp_compose(parent, index)
        finally:
            if pushed:
                self._hp_path.pop()

    def _hp_compose(self, parent: Any, index: Any) -> Any:
        compose = super().compose_node  # type: ignore[misc]
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            anchor = event.anchor
            if anchor in self._hp_open:
                raise self._hp_refuse(
                    f"alias *{anchor} refers to a node that contains it",
                    event.start_mark,
                    limit=None,
                    env=None,
                    fix="a recursive document never ends once expanded, so hp refuses it. Write the value out.",
                )
            if anchor in self.anchors:
                self._hp_count(self._hp_sizes.get(anchor, 1), event, anchor)
            return compose(parent, index)
        self._hp_count(1, event, None)
        collection = isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent))
        if collection:
            limit = self._hp_limits.max_depth
            if self._hp_depth >= limit:
                raise self._hp_refuse(
                    f"nesting depth over {limit}",
                    event.start_mark,
                    limit=limit,
                    env=ENV_MAX_DEPTH,
                    fix=f"hp refuses deeper documents. {_raise_hint(ENV_MAX_DEPTH, 2 * limit)}",
                )
            self._hp_depth += 1
        anchor = getattr(event, "anchor", None)
        start = self._hp_total - 1
        if anchor is not None:
            self._hp_open.add(anchor)
        try:
            node = compose(parent, index)
        finally:
            if collection:
                self._hp_depth -= 1
            if anchor is not None:
                self._hp_open.discard(anchor)
        if anchor is not None:
            self._hp_sizes[anchor] = self._hp_total - start
        return node


_BOUNDED_LOADERS: dict[type, type] = {}


def _bounded_loader(loader: type) -> type:
    cls = _BOUNDED_LOADERS.get(loader)
    if cls is None:
        cls = type(f"Bounded{loader.__name__}", (_BoundedComposer, loader), {"__module__": __name__})
        _BOUNDED_LOADERS[loader] = cls
    return cls


def load_yaml(
    text: str | bytes,
    *,
    source: str = "<yaml>",
    loader: type = yaml.SafeLoader,
    max_bytes: int | None = None,
    max_depth: int | None = None,
    max_nodes: int | None = None,
    error: type[InputLimitError] | None = None,
) -> Any:
    """One YAML document read with ``loader`` (default ``yaml.SafeLoader``) under the caps.

    The size is checked first; depth and alias expansion while the document is composed,
    before the parser recurses or anything is built. ``yaml.YAMLError`` propagates for
    text that is not YAML. Refusals raise ``error`` (default :class:`InputLimitError`). ``loader`` must be
    a pure-Python loader (``yaml.SafeLoader`` or a subclass): libyaml's ``CParser`` composes
    in C, where the caps cannot reach.
    """
    if not issubclass(loader, yaml.composer.Composer):
        raise TypeError(
            f"load_yaml: {loader.__name__} does not compose in Python (libyaml's loaders compose in C); "
            "pass yaml.SafeLoader or a subclass of it."
        )
    cls = _error_class(error)
    limits = InputLimits.current(max_bytes=max_bytes, max_depth=max_depth, max_nodes=max_nodes, error=cls)
    check_size(text, source=source, max_bytes=limits.max_bytes, error=cls)
    if isinstance(text, (bytes, bytearray)):
        text = text.decode("utf-8")
    instance = _bounded_loader(loader)(text)
    instance._hp_setup(limits, source, cls)
    try:
        return instance.get_single_data()
    except RecursionError:
        raise _too_deep_for_python(cls, source, limits) from None
    finally:
        instance.dispose()
