"""The plugin system's state and its public entry points: discover, report, reset, register.

Discovery is lazy and runs once per process (the first registry access or report
triggers it; :func:`reset_plugins` forgets it). How one plugin is loaded in isolation:
``_loading``; how entry points are found and imported within a time bound:
``_discovery``; how hooks are called: ``_hookcall``.
"""

from __future__ import annotations

import types

import pluggy

from hp_core.plugins._config import ENV_STRICT, strict_from_env
from hp_core.plugins._errors import PluginLoadError
from hp_core.plugins._items import PluginInfo
from hp_core.plugins._loading import load_all, load_one
from hp_core.plugins._state import (
    LOADING,
    LOCK,
    PluginState,
    check_not_loading_thread,
    loading_error,
)

__all__ = [
    "current_state",
    "load_plugins",
    "plugin_manager",
    "plugin_packages",
    "plugin_report",
    "plugin_warnings",
    "register_plugin",
    "reset_plugins",
]

_STATE: PluginState | None = None


def current_state(*, strict: bool | None = None) -> PluginState:
    """The loaded state, discovering plugins on first use.

    ``strict=None`` follows ``HP_PLUGINS_STRICT``; when strict and any plugin failed,
    raises :class:`PluginLoadError`.
    """
    global _STATE
    check_not_loading_thread()
    with LOCK:
        if _STATE is None:
            if LOADING.active:
                raise loading_error()
            _STATE = load_all()
        state = _STATE
    if strict is None:
        strict = strict_from_env()
    if strict:
        _raise_if_failed(state)
    return state


def plugin_manager() -> pluggy.PluginManager:
    """The pluggy ``PluginManager`` holding the loaded plugins (discovering them first).

    For pluggy's own tools: ``plugin_manager().add_hookcall_monitoring(before, after)`` and
    ``plugin_manager().enable_tracing()`` see the hook calls of the plugins loaded from then
    on (with :func:`register_plugin`; a rediscovery after :func:`reset_plugins` makes a new
    manager). Register plugins through hp, not with ``pm.register``.
    """
    return current_state(strict=False).pm


def load_plugins(*, strict: bool = False) -> list[PluginInfo]:
    """Discover and load plugins now (a no-op if already done); return the report.

    ``strict=True`` (or ``HP_PLUGINS_STRICT=1``) raises :class:`PluginLoadError` when
    any plugin failed or ``HP_PLUGINS`` names a plugin that is not installed.
    """
    state = current_state(strict=strict or None)
    return list(state.report)


def plugin_report() -> list[PluginInfo]:
    """Every plugin found: built-in, loaded, failed and disabled. Never raises for failures."""
    return list(current_state(strict=False).report)


def plugin_warnings() -> list[str]:
    """Non-fatal problems found during discovery (e.g. unknown names in ``HP_PLUGINS``)."""
    return list(current_state(strict=False).warnings)


def plugin_packages() -> frozenset[str]:
    """Top-level import packages of the loaded hp plugin distributions (and ``hp_core``).

    ``hp_core.injection.Target`` imports a dotted path only from these packages (or
    ones the user trusts explicitly).
    """
    return frozenset(current_state(strict=False).packages)


def reset_plugins() -> None:
    """Forget every loaded plugin and user registration; the next access rediscovers.

    A test helper: call it after changing ``sys.path`` or the ``HP_*`` environment
    variables. Imported plugin modules stay in ``sys.modules``.
    """
    global _STATE
    with LOCK:
        _STATE = None


def register_plugin(plugin: object, *, name: str) -> PluginInfo:
    """Load a plugin object (a module or an object with ``@hookimpl`` methods) by hand.

    Goes through the same validation as an entry-point plugin (provider ``name``,
    distribution None). On any failure raises :class:`PluginLoadError` and changes
    nothing. A module's top-level package joins :func:`plugin_packages`. Handy for
    testing a plugin without installing it.
    """
    if not isinstance(name, str) or not name.strip():
        raise PluginLoadError(
            f"register_plugin(name={name!r}): the provider name must be a non-empty string "
            "(it is how hp plugins and error messages name the plugin), e.g. "
            "register_plugin(plugin, name='my_plugin')."
        )
    check_not_loading_thread()
    with LOCK:
        state = current_state(strict=False)
        info = load_one(state, name, lambda: plugin, distribution=None, version=None, packages=())
        if info.status == "failed":
            # load_one committed nothing; tell the caller instead of adding a report row.
            raise PluginLoadError(
                f"plugin {name!r} (registered with register_plugin) failed to load: {info.error}",
                [info],
            )
        state.report.append(info)
        if isinstance(plugin, types.ModuleType):
            # Its package is imported already; Target may import from it like any plugin's.
            state.packages.add(plugin.__name__.split(".", 1)[0])
        return info


def _raise_if_failed(state: PluginState) -> None:
    failures = state.failures()
    if not failures and not state.warnings:
        return
    if failures:
        culprits = ", ".join(info.describe() for info in failures)
        lines = [f"hp plugin(s) failed to load (strict mode): {culprits}"]
    else:
        lines = [f"hp plugin selection problem (strict mode): {state.warnings[0]}"]
    lines.extend(f"- {info.describe()}: {info.error}" for info in failures)
    lines.extend(f"- {warning}" for warning in state.warnings)
    lines.append(
        "Fix: repair or uninstall the plugin, or leave it out with HP_PLUGINS=<names to load>; "
        f"unset {ENV_STRICT} / drop strict=True to load the rest anyway."
    )
    raise PluginLoadError("\n".join(lines), failures)
