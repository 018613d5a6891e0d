"""``load_yaml``: one YAML document read under hp's caps, alias bombs refused while composing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import yaml

from hp_core.bounded.limits import (
    ENV_MAX_DEPTH,
    ENV_MAX_NODES,
    InputLimitError,
    InputLimits,
    check_size,
    error_class,
    format_path,
    located,
    raise_hint,
    refusal,
    too_deep_for_python,
)

__all__ = ["load_yaml"]

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

    def _hp_refuse(
        self, what: str, mark: Any, *, limit: int | None, env: str | None, fix: str
    ) -> InputLimitError:
        path = format_path([p for p in self._hp_path if p is not _KEY])
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        return refusal(
            self._hp_error,
            f"{located(self._hp_source, path)}: {what}{at}; {fix}",
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
                fix="hp refuses it (YAML aliases that expand like this are an alias bomb, and "
                "no plan "
                f"needs that many nodes). {raise_hint(ENV_MAX_NODES, 10 * limit)}",
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
                    fix="a recursive document never ends once expanded, so hp refuses it. "
                    "Write the value out.",
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
                    fix=f"hp refuses deeper documents. {raise_hint(ENV_MAX_DEPTH, 2 * limit)}",
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
        bases = (_BoundedComposer, loader)
        cls = type(f"Bounded{loader.__name__}", bases, {"__module__": __name__})
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
    text that is not YAML. Refusals raise ``error`` (default :class:`InputLimitError`).
    ``loader`` must be a pure-Python loader (``yaml.SafeLoader`` or a subclass): libyaml's
    ``CParser`` composes in C, where the caps cannot reach.
    """
    if not issubclass(loader, yaml.composer.Composer):
        raise TypeError(
            f"load_yaml: {loader.__name__} does not compose in Python "
            "(libyaml's loaders compose in C); "
            "pass yaml.SafeLoader or a subclass of it."
        )
    cls = error_class(error)
    limits = InputLimits.current(
        max_bytes=max_bytes, max_depth=max_depth, max_nodes=max_nodes, error=cls
    )
    check_size(text, source=source, max_bytes=limits.max_bytes, error=cls)
    if isinstance(text, (bytes, bytearray)):
        text = text.decode("utf-8")
    instance = _bounded_loader(loader)(text)
    instance._hp_setup(limits, source, cls)
    try:
        return instance.get_single_data()
    except RecursionError:
        raise too_deep_for_python(cls, source, limits) from None
    finally:
        instance.dispose()
