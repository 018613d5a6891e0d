"""The versioned plugin contract: a plugin declares the hp plugin API it was built for.

The hook specs and the injection signatures form one contract, numbered
:data:`hp_core.hookspecs.PLUGIN_API_VERSION`. A plugin object declares the version it
was built for as ``HP_PLUGIN_API = 2`` (a module attribute, or a class attribute of a
plugin object). hp checks it right after importing the plugin, before the plugin is
registered with pluggy or any of its hooks runs; a plugin that declares another version,
or none, fails like any other broken plugin (reported, or raised in strict mode).
"""

from __future__ import annotations

import importlib.metadata as importlib_metadata

from hp_core.hookspecs import PLUGIN_API_ATTRIBUTE, PLUGIN_API_VERSION
from hp_core.plugins._config import CORE_DISTRIBUTION
from hp_core.plugins._items import Provider
from hp_core.plugins._state import PluginFailure

__all__ = ["check_plugin_api", "core_version"]

_MISSING = object()


def core_version() -> str | None:
    """The installed hp-core version (from its distribution metadata), or None."""
    try:
        return importlib_metadata.version(CORE_DISTRIBUTION)
    except importlib_metadata.PackageNotFoundError:
        return None


def check_plugin_api(plugin: object, provider: Provider) -> None:
    """Raise ``PluginFailure`` unless ``plugin`` declares this hp-core's plugin API version."""
    declared = getattr(plugin, PLUGIN_API_ATTRIBUTE, _MISSING)
    if type(declared) is int and declared == PLUGIN_API_VERSION:
        return
    version = core_version()
    core = f"this {CORE_DISTRIBUTION}{f' {version}' if version else ''}"
    if declared is _MISSING:
        what = f"declares no plugin API version (no {PLUGIN_API_ATTRIBUTE} attribute)"
    else:
        what = f"declares {PLUGIN_API_ATTRIBUTE} = {declared!r}"
    dist = provider.distribution
    upgrade = f"pip install -U {dist}" if dist else "update the plugin"
    raise PluginFailure(
        f"{provider.describe()} {what}, but {core} supports plugin API {PLUGIN_API_VERSION} "
        "only.\n"
        "A plugin declares the version of the hp plugin contract (hook specs and injection "
        "signatures) it was built for, and hp loads only plugins built for the version it "
        "supports.\n"
        f"Fix: install a release of the plugin built for hp plugin API {PLUGIN_API_VERSION} "
        f"({upgrade}), or leave it out with HP_PLUGINS=<other names>; plugin authors: port "
        f"the injections to fn(module, ctx, **config) and set {PLUGIN_API_ATTRIBUTE} = "
        f"{PLUGIN_API_VERSION} in the plugin module."
    )
