"""What discovery produced (:class:`PluginState`), the registry lock and the loading flags.

The flags let a registry access made from a plugin's own import or hook be refused with
a clear message instead of deadlocking or recursing into discovery.
"""

from __future__ import annotations

import dataclasses
import threading

import pluggy

import hp_core.hookspecs as hookspecs
from hp_core.plugins._items import PluginInfo, RegisteredItem, RegistryKind

__all__ = [
    "LOADING",
    "LOCK",
    "PluginFailure",
    "PluginState",
    "check_not_loading_thread",
    "describe_exception",
    "loading_error",
]


class PluginFailure(Exception):
    """Internal: one plugin failed; ``message`` is the report's ``error`` text."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def describe_exception(e: BaseException) -> str:
    """``Type: message`` (just ``Type`` when the message is empty)."""
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@dataclasses.dataclass
class PluginState:
    """Everything discovery produced: the pluggy manager, the items, the report.

    Replaced wholesale by a rediscovery (:func:`hp_core.plugins.reset_plugins`).
    """

    pm: pluggy.PluginManager
    items: dict[RegistryKind, dict[str, RegisteredItem]]
    report: list[PluginInfo]
    warnings: list[str]
    packages: set[str]

    @classmethod
    def empty(cls) -> PluginState:
        """A state with the hook specs declared and nothing loaded."""
        return cls(
            pm=_new_manager(),
            items={k: {} for k in RegistryKind},
            report=[],
            warnings=[],
            packages=set(),
        )

    def failures(self) -> list[PluginInfo]:
        """The report rows of the plugins that failed to load."""
        return [p for p in self.report if p.status == "failed"]

    def plugin_names(self) -> dict[str, PluginInfo]:
        """Name → report row of every plugin that is loaded (the built-in included)."""
        return {p.name: p for p in self.report if p.status in ("loaded", "builtin")}


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


class _Loading:
    """Process-wide loading flags: whether discovery runs and which plugin it is on."""

    def __init__(self) -> None:
        self.active = False
        self.plugin: str | None = None  # the plugin being imported / called, for messages
        #: ``plugin`` is set (to the entry-point name) in the threads that import plugins.
        self.thread = threading.local()


#: The registry lock: discovery and every registry mutation hold it.
LOCK = threading.RLock()
LOADING = _Loading()


def loading_error() -> RuntimeError:
    """The error for a registry access made while plugins are being loaded."""
    who = f"plugin {LOADING.plugin!r}" if LOADING.plugin else "a plugin"
    return RuntimeError(
        f"{who} accessed the hp plugin registries while plugins are being loaded "
        "(from its import or a hook).\nPlugins only register items while loading.\n"
        "Fix: look items up lazily, at call time, not at import time."
    )


def check_not_loading_thread() -> None:
    """Refuse registry access from a plugin's import thread while discovery runs.

    Called before taking the registry lock: the discovering thread holds it while it waits
    for the import, so the import thread would otherwise block until its time runs out.
    """
    if LOADING.active and getattr(LOADING.thread, "plugin", None) is not None:
        raise loading_error()
