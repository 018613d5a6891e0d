"""The plugin layer's plain data: registry kinds, providers, registered items, report rows.

Nothing here validates or touches registry state (validation: ``_validate``; the one
declaration of each kind: ``_kinds``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Literal

__all__ = [
    "FORWARD_STYLES",
    "USER_PROVIDER",
    "PluginInfo",
    "PluginStatus",
    "Provider",
    "RegisteredItem",
    "RegistryKind",
]

PluginStatus = Literal["loaded", "failed", "disabled", "builtin"]

FORWARD_STYLES: tuple[str, ...] = ("any", "qkv", "hf")

#: Provider name of items registered programmatically with ``register_*``.
USER_PROVIDER = "user"


class RegistryKind(StrEnum):
    """The registries; values are the names used in messages and ``lookup``."""

    TEMPLATE = "template"
    INNER_WRAPPER = "inner_wrapper"
    COMPUTE_FACTORY = "compute_factory"
    ROUTER_ADAPTER = "router_adapter"
    TRAINING_ADAPTER = "training_adapter"

    @property
    def label(self) -> str:
        """The kind in words, for messages (``"inner wrapper"``)."""
        return self.value.replace("_", " ")


@dataclasses.dataclass(frozen=True)
class Provider:
    """Who registered an item: a plugin (with its distribution) or the user."""

    name: str
    distribution: str | None = None
    version: str | None = None

    def describe(self) -> str:
        """``plugin 'cp' (hp-plugin-cp 0.1.0)`` or ``register_* call (provider 'user')``."""
        if self.name == USER_PROVIDER and self.distribution is None:
            return "provider 'user' (a register_* call)"
        if self.distribution is None:
            return f"plugin {self.name!r}"
        version = f" {self.version}" if self.version else ""
        return f"plugin {self.name!r} ({self.distribution}{version})"


@dataclasses.dataclass(frozen=True, eq=False)
class RegisteredItem:
    """One registry entry and the plugin that registered it.

    ``meta`` holds the static requirements given at registration: ``needs_cp``,
    ``region_dispatch``, ``forward_style`` for inner wrappers; ``architectures`` for
    compute factories and architecture-scoped templates. ``collectives`` (inner wrappers
    and compute factories; None when not declared) is ``(sizes, config) -> [Collective]``:
    the collectives the item issues per call, for the planner's prediction.
    """

    kind: RegistryKind
    name: str
    value: Any
    provider: str
    distribution: str | None
    version: str | None
    meta: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    collectives: Callable[..., Any] | None = None

    def describe_provider(self) -> str:
        """The provider in words, e.g. ``plugin 'cp' (hp-plugin-cp 0.1.0)``."""
        return Provider(self.provider, self.distribution, self.version).describe()


@dataclasses.dataclass(frozen=True)
class PluginInfo:
    """One row of :func:`hp_core.plugins.plugin_report`.

    ``status``: ``builtin`` (the core's own plugin), ``loaded``, ``failed`` (``error``
    says why; none of its items were registered) or ``disabled`` (found but not loaded
    because of ``HP_DISABLE_PLUGIN_AUTOLOAD`` / ``HP_PLUGINS``; ``note`` says which).
    """

    name: str
    distribution: str | None
    version: str | None
    status: PluginStatus
    error: str | None = None
    items: int = 0
    note: str | None = None

    def describe(self) -> str:
        """This plugin in words, e.g. ``plugin 'cp' (hp-plugin-cp 0.1.0)``."""
        return Provider(self.name, self.distribution, self.version).describe()
