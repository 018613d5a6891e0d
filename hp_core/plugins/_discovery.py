"""Finding plugins: entry points, the ``HP_PLUGINS`` selection, and the bounded import.

The import bound (``HP_PLUGIN_IMPORT_TIMEOUT``, seconds, default
:data:`DEFAULT_IMPORT_TIMEOUT`): Python cannot kill a thread or interrupt an import,
so each entry point is imported in its own daemon thread and the loader waits for it
with ``join(timeout)``. If the import has not finished by then, the plugin is
reported as failed ("did not finish within N s") and discovery goes on without it;
the thread is abandoned, not stopped: it keeps running (daemon, so it never keeps the
process alive) and whatever it eventually produces is ignored until the next
rediscovery. While it runs it holds the import lock of the module(s) it is importing,
so another import of *that* module blocks (a rediscovery times out on it again);
imports of any other module are unaffected. ``HP_PLUGIN_IMPORT_TIMEOUT=0`` (or
``off``/``none``) removes the bound and imports in the calling thread, as does
discovery started while the calling thread is itself importing a module (e.g. a
module that registers items at import time): that thread holds module locks an import
thread might need, so waiting for one could only time out. The bound covers the
import, where plugins do their expensive work; hooks run in the calling thread (they
only call ``register``).
"""

from __future__ import annotations

import importlib.metadata as importlib_metadata
import os
import threading
from collections.abc import Callable
from typing import Any

from hp_core.plugins._config import (
    ENTRY_POINT_GROUP,
    ENV_DISABLE_AUTOLOAD,
    ENV_IMPORT_TIMEOUT,
    ENV_PLUGINS,
    env_true,
)
from hp_core.plugins._state import LOADING, PluginFailure, describe_exception

__all__ = [
    "dist_name",
    "dist_version",
    "entry_point_loader",
    "entry_points",
    "importing_in_this_thread",
    "selection",
    "top_level_packages",
]


def entry_points() -> list[importlib_metadata.EntryPoint]:
    # By name; for two distributions with one entry-point name, sys.path order decides
    # (the earlier one loads, like an import would), and the other is reported failed.
    eps = importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
    return sorted(eps, key=lambda ep: ep.name)


def dist_name(ep: importlib_metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None
    return dist.metadata["Name"] or None


def dist_version(ep: importlib_metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return None if dist is None else dist.version


def selection() -> tuple[set[str] | None, str | None]:
    """(names allowed by the environment or None for all, note for the others)."""
    if env_true(ENV_DISABLE_AUTOLOAD):
        return set(), f"{ENV_DISABLE_AUTOLOAD}=1"
    raw = os.environ.get(ENV_PLUGINS)
    if raw is None:
        return None, None
    names = {n.strip() for n in raw.split(",") if n.strip()}
    return names, f"not listed in {ENV_PLUGINS}={raw}"


def importing_in_this_thread() -> bool:
    """Whether the calling thread is executing a module's import (holds a module lock).

    Reads CPython's import-lock table; where that is not available, answers False.
    """
    try:
        from importlib import _bootstrap

        me = threading.get_ident()
        # A private CPython table typeshed does not declare.
        for ref in list(_bootstrap._module_locks.values()):  # type: ignore[attr-defined]
            lock = ref()
            if lock is not None and getattr(lock, "owner", None) == me:
                return True
    except Exception:
        return False
    return False


def entry_point_loader(
    ep: importlib_metadata.EntryPoint, timeout: float | None
) -> Callable[[], Any]:
    """Import ``ep`` (bounded by ``timeout`` seconds, see the module docstring)."""
    what = f"importing entry point '{ep.name} = {ep.value}'"

    def failure(e: BaseException) -> PluginFailure:
        if isinstance(e, KeyboardInterrupt):
            raise e
        return PluginFailure(f"{what} raised {describe_exception(e)}")

    def load() -> Any:
        if timeout is None or importing_in_this_thread():
            try:
                return ep.load()
            except BaseException as e:
                raise failure(e) from e
        outcome: dict[str, Any] = {}

        def run() -> None:
            LOADING.thread.plugin = ep.name
            try:
                outcome["value"] = ep.load()
            except BaseException as e:  # handed to the loading thread
                outcome["error"] = e

        thread = threading.Thread(target=run, name=f"hp-plugin-import:{ep.name}", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise PluginFailure(
                f"{what} timed out: it did not finish within {timeout:g} s.\n"
                "hp stopped waiting and loaded the other plugins; the import goes on in a "
                "background thread whose result is ignored.\n"
                f"Fix: make the plugin's import fast, or set {ENV_IMPORT_TIMEOUT} to a higher "
                "number of seconds (0 for no limit)."
            )
        if "error" in outcome:
            error = outcome.pop("error")
            raise failure(error) from error
        return outcome["value"]

    return load


def top_level_packages(ep: importlib_metadata.EntryPoint) -> set[str]:
    """Import packages a plugin distribution ships: top_level.txt, RECORD, entry point."""
    packages = {ep.module.split(".", 1)[0]}
    dist = getattr(ep, "dist", None)
    if dist is None:
        return packages
    top_level = dist.read_text("top_level.txt") or ""
    packages.update(line.strip() for line in top_level.splitlines() if line.strip())
    for path in dist.files or ():
        parts = path.parts
        head = parts[0] if parts else ""
        if head.startswith("__editable__") or head.endswith((".dist-info", ".egg-info")):
            continue
        if len(parts) > 1 and head.isidentifier() and head != "__pycache__":
            packages.add(head)
        elif len(parts) == 1 and head.endswith(".py") and head[:-3].isidentifier():
            packages.add(head[:-3])
    return packages
