"""Loading plugins in isolation: the built-in one, every entry point, one object by hand.

Each plugin is loaded on its own: import, check the plugin API version it declares,
register it with pluggy, ``check_pending``, call each of its hooks with a ``register``
callback bound to it, validate every item, and only then commit them all at once. A
plugin that fails at any step is reported as ``failed`` and contributes nothing; the
core and the other plugins carry on.

What counts as failing: any exception, and any other ``BaseException`` (``SystemExit``
from a ``sys.exit()`` at import or in a hook, ``GeneratorExit``, a custom subclass)
raised by the plugin's import, its registration with pluggy or its hooks. Only
``KeyboardInterrupt`` propagates, so Ctrl-C still stops hp. A plugin can therefore
neither end the process nor change the exit code of an unrelated command.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import pluggy

from hp_core.hookspecs import PROJECT_NAME
from hp_core.plugins._config import (
    BUILTIN_PLUGIN_MODULE,
    BUILTIN_PLUGIN_NAME,
    CORE_DISTRIBUTION,
    ENTRY_POINT_GROUP,
    ENV_DISABLE_AUTOLOAD,
    ENV_PLUGINS,
    env_true,
    import_timeout_from_env,
)
from hp_core.plugins._conflicts import check_conflicts
from hp_core.plugins._contract import check_plugin_api, core_version
from hp_core.plugins._discovery import (
    dist_name,
    dist_version,
    entry_point_loader,
    entry_points,
    selection,
    top_level_packages,
)
from hp_core.plugins._errors import DuplicateRegistrationError
from hp_core.plugins._hookcall import check_pending, collect
from hp_core.plugins._items import USER_PROVIDER, PluginInfo, PluginStatus, Provider, RegisteredItem
from hp_core.plugins._state import LOADING, PluginFailure, PluginState, describe_exception
from hp_core.spec.keywords import did_you_mean

__all__ = ["HpPluginWarning", "load_all", "load_one"]


class HpPluginWarning(UserWarning):
    """A plugin problem that does not stop hp (e.g. an unknown name in ``HP_PLUGINS``)."""


def load_all() -> PluginState:
    """Discover and load every plugin into a new state (the built-in one first)."""
    LOADING.active = True
    try:
        state = PluginState.empty()
        _load_builtin(state)
        _load_entry_points(state)
        for message in state.warnings:
            warnings.warn(message, HpPluginWarning, stacklevel=4)
        return state
    finally:
        LOADING.active = False


def _load_builtin(state: PluginState) -> None:
    info = load_one(
        state,
        BUILTIN_PLUGIN_NAME,
        lambda: importlib.import_module(BUILTIN_PLUGIN_MODULE),
        distribution=CORE_DISTRIBUTION,
        version=core_version(),
        packages=("hp_core",),
        status="builtin",
    )
    state.report.append(info)


def _load_entry_points(state: PluginState) -> None:
    eps = entry_points()
    allowed, note = selection()
    timeout, problem = import_timeout_from_env()
    if problem is not None:
        state.warnings.append(problem)
    found = {ep.name for ep in eps}
    if allowed is not None and not env_true(ENV_DISABLE_AUTOLOAD):
        for name in sorted(allowed - found - {BUILTIN_PLUGIN_NAME}):
            installed = ", ".join(sorted(found)) or "none"
            state.warnings.append(
                f"{ENV_PLUGINS} names plugin {name!r}, but no installed plugin has that "
                f"entry-point name.{did_you_mean(name, found)} Installed plugins: {installed}."
            )
    for ep in eps:
        dist, version = dist_name(ep), dist_version(ep)
        if allowed is not None and ep.name not in allowed:
            state.report.append(PluginInfo(ep.name, dist, version, "disabled", note=note))
            continue
        info = load_one(
            state,
            ep.name,
            entry_point_loader(ep, timeout),
            distribution=dist,
            version=version,
            packages=top_level_packages(ep),
        )
        state.report.append(info)


def load_one(
    state: PluginState,
    name: str,
    load: Callable[[], Any],
    *,
    distribution: str | None,
    version: str | None,
    packages: Iterable[str],
    status: PluginStatus = "loaded",
) -> PluginInfo:
    """Load one plugin into ``state`` and return its report row (not appended).

    On failure ``state`` is left untouched and the row says why.
    """
    provider = Provider(name, distribution, version)
    registered = False
    LOADING.plugin = name
    try:
        taken = state.plugin_names().get(name)
        reserved = name == USER_PROVIDER or (name == BUILTIN_PLUGIN_NAME and status != "builtin")
        if taken is not None or reserved:
            owner = taken.describe() if taken else "hp itself (reserved name)"
            raise PluginFailure(
                f"plugin name {name!r} is already used by {owner}.\n"
                "Plugin (entry-point) names are unique.\n"
                f"Fix: give the entry point in the [project.entry-points.{ENTRY_POINT_GROUP}] "
                "table of its pyproject.toml another name."
            )
        plugin = load()
        check_plugin_api(plugin, provider)
        try:
            state.pm.register(_hashable(state.pm, plugin), name=name)
        except pluggy.PluginValidationError as e:
            raise PluginFailure(f"invalid hook implementation: {e}") from e
        except ValueError as e:
            raise PluginFailure(f"cannot register the plugin object: {e}") from e
        registered = True
        check_pending(state.pm, name)
        staged = collect(state.pm, name, provider)
        _check_duplicates(state, staged)
    except KeyboardInterrupt:
        if registered:
            state.pm.unregister(name=name)
        raise
    except BaseException as e:  # a plugin never ends hp: everything else fails the plugin
        if registered:
            state.pm.unregister(name=name)
        if isinstance(e, PluginFailure):
            message = e.message
        else:
            message = f"loading it raised {describe_exception(e)}"
        return PluginInfo(name, distribution, version, "failed", error=message)
    finally:
        LOADING.plugin = None
    for item in staged:
        state.items[item.kind][item.name] = item
    state.packages.update(packages)
    return PluginInfo(name, distribution, version, status, items=len(staged))


class _PluginView:
    """A hashable stand-in for an unhashable plugin object (e.g. a ``SimpleNamespace``).

    pluggy keeps plugins in sets when it calls one plugin's hooks (``subset_hook_caller``),
    so a plugin object must be hashable; the view carries the object's hook
    implementations (bound, as pluggy would find them) as its own attributes.
    """

    def __init__(self, target: object) -> None:
        self.target = target
        marker = f"{PROJECT_NAME}_impl"
        for attr in dir(target):
            try:
                static = inspect.getattr_static(target, attr)
            except AttributeError:
                continue
            if hasattr(static, marker) or hasattr(getattr(static, "__func__", None), marker):
                setattr(self, attr, getattr(target, attr))

    def __repr__(self) -> str:
        return repr(self.target)


def _hashable(pm: pluggy.PluginManager, plugin: object) -> object:
    """``plugin`` itself, or a :class:`_PluginView` of it if it cannot be hashed."""
    try:
        hash(plugin)
        return plugin
    except TypeError:
        pass
    for name, existing in pm.list_name_plugin():
        if isinstance(existing, _PluginView) and existing.target is plugin:
            raise ValueError(f"Plugin already registered under a different name: {name}={plugin!r}")
    return _PluginView(plugin)


def _check_duplicates(state: PluginState, staged: list[RegisteredItem]) -> None:
    try:
        check_conflicts(state, staged)
    except DuplicateRegistrationError as e:
        raise PluginFailure(str(e)) from e
