"""hp's plugin system: entry-point discovery, registries with provenance, user registration.

Plugins are distributions with an entry point in the ``hp_core`` group whose object
(usually a module) implements the hooks in :mod:`hp_core.hookspecs`. Discovery is lazy
and happens once per process; every registered item records the plugin (and
distribution) that provided it. See ``docs/plugins.md``.

Environment switches:

- ``HP_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry-point plugins (the built-in still loads);
- ``HP_PLUGINS=cp,moe``: load only these entry-point names (``HP_PLUGINS=`` loads none);
- ``HP_PLUGINS_STRICT=1``: a plugin failure raises :class:`PluginLoadError` instead of
  being reported;
- ``HP_PLUGIN_IMPORT_TIMEOUT=10``: seconds one plugin's import may take before it is
  reported as failed (``0``: no limit).

A plugin declares the plugin API it was built for (``HP_PLUGIN_API =``
:data:`PLUGIN_API_VERSION`); one built for another version, or declaring none, is refused
like any failed plugin. The registry kinds are declared once, in :data:`REGISTRY_KINDS`.
A distribution declares the items it provides in the entry-point group ``hp_core.items``
(:data:`ITEMS_GROUP`), so a missing item's provider is named without importing anything.

Layout (each module imports only those above it in this list): ``_errors``, ``_items``
(plain data), ``_validate`` (one registration), ``_kinds`` (the one row per kind),
``_config`` (names, environment), ``_state``, ``_conflicts``, ``_discovery`` (entry
points, bounded import), ``_contract`` (the API version), ``_hookcall`` (hooks through
pluggy), ``_loading`` (one plugin in isolation), ``_manager`` (discover, report, reset),
``_declared`` (the items installed distributions declare in ``hp_core.items``),
``_registry`` (views, lookups, user registration).
"""

from __future__ import annotations

from hp_core.hookspecs import (
    PLUGIN_API_ATTRIBUTE,
    PLUGIN_API_VERSION,
    hookimpl,
    hookspec,
)
from hp_core.plugins._config import (
    BUILTIN_PLUGIN_MODULE,
    BUILTIN_PLUGIN_NAME,
    DEFAULT_IMPORT_TIMEOUT,
    ENTRY_POINT_GROUP,
    ENV_DISABLE_AUTOLOAD,
    ENV_IMPORT_TIMEOUT,
    ENV_PLUGINS,
    ENV_STRICT,
    strict_from_env,
)
from hp_core.plugins._declared import (
    ITEMS_GROUP,
    DeclaredItem,
    RecordedProvider,
    declared_items,
    declared_problems,
    declared_providers,
)
from hp_core.plugins._errors import (
    DuplicateRegistrationError,
    InvalidRegistrationError,
    PluginLoadError,
    UnknownRegistryItemError,
    UnknownRegistryKindError,
)
from hp_core.plugins._items import (
    FORWARD_STYLES,
    USER_PROVIDER,
    PluginInfo,
    PluginStatus,
    RegisteredItem,
    RegistryKind,
)
from hp_core.plugins._kinds import KIND_SPECS, REGISTRY_KINDS, KindSpec
from hp_core.plugins._loading import HpPluginWarning
from hp_core.plugins._manager import (
    current_state,
    load_plugins,
    plugin_manager,
    plugin_packages,
    plugin_report,
    plugin_warnings,
    register_plugin,
    reset_plugins,
)
from hp_core.plugins._registry import (
    COMPUTE_FACTORY_REGISTRY,
    INNER_WRAPPER_REGISTRY,
    ROUTER_ADAPTER_REGISTRY,
    TEMPLATE_REGISTRY,
    TRAINING_ADAPTER_REGISTRY,
    PluginRegistry,
    ProtectedRegistryItemError,
    lookup,
    register_compute_factory,
    register_inner_wrapper,
    register_router_adapter,
    register_template,
    register_training_adapter,
    registered_items,
    suggest_compute_factory,
    unregister,
)
from hp_core.plugins._state import PluginState

__all__ = [
    "BUILTIN_PLUGIN_MODULE",
    "BUILTIN_PLUGIN_NAME",
    "COMPUTE_FACTORY_REGISTRY",
    "DEFAULT_IMPORT_TIMEOUT",
    "ENTRY_POINT_GROUP",
    "ENV_DISABLE_AUTOLOAD",
    "ENV_IMPORT_TIMEOUT",
    "ENV_PLUGINS",
    "ENV_STRICT",
    "FORWARD_STYLES",
    "INNER_WRAPPER_REGISTRY",
    "ITEMS_GROUP",
    "KIND_SPECS",
    "PLUGIN_API_ATTRIBUTE",
    "PLUGIN_API_VERSION",
    "REGISTRY_KINDS",
    "ROUTER_ADAPTER_REGISTRY",
    "TEMPLATE_REGISTRY",
    "TRAINING_ADAPTER_REGISTRY",
    "USER_PROVIDER",
    "DeclaredItem",
    "DuplicateRegistrationError",
    "HpPluginWarning",
    "InvalidRegistrationError",
    "KindSpec",
    "PluginInfo",
    "PluginLoadError",
    "PluginRegistry",
    "PluginState",
    "PluginStatus",
    "ProtectedRegistryItemError",
    "RecordedProvider",
    "RegisteredItem",
    "RegistryKind",
    "UnknownRegistryItemError",
    "UnknownRegistryKindError",
    "current_state",
    "declared_items",
    "declared_problems",
    "declared_providers",
    "hookimpl",
    "hookspec",
    "load_plugins",
    "lookup",
    "plugin_manager",
    "plugin_packages",
    "plugin_report",
    "plugin_warnings",
    "register_compute_factory",
    "register_inner_wrapper",
    "register_plugin",
    "register_router_adapter",
    "register_template",
    "register_training_adapter",
    "registered_items",
    "reset_plugins",
    "strict_from_env",
    "suggest_compute_factory",
    "unregister",
]
