"""Exceptions raised by the plugin system."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hp_core.errors import HpError

if TYPE_CHECKING:
    from hp_core.plugins._items import PluginInfo

__all__ = [
    "DuplicateRegistrationError",
    "InvalidRegistrationError",
    "PluginLoadError",
    "UnknownRegistryItemError",
    "UnknownRegistryKindError",
]


class InvalidRegistrationError(HpError, ValueError):
    """A registered item is malformed: a bad name, option value or non-callable."""


class DuplicateRegistrationError(HpError, ValueError):
    """A name is already registered; the message names both providers."""


class UnknownRegistryItemError(HpError, LookupError, ValueError):
    """A registry lookup for a name nobody registered.

    ``str(err)`` is the readable message (known names with their providers and the
    closest match), unlike ``KeyError`` which shows the repr of its argument.
    """

    def __init__(self, message: str, *, kind: str = "", name: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.name = name

    def __str__(self) -> str:
        return self.message


class _UnknownRegistryKeyError(UnknownRegistryItemError, KeyError):
    """Raised by ``registry[name]`` so the ``Mapping`` protocol (``except KeyError``) holds."""


class UnknownRegistryKindError(HpError, ValueError):
    """A registry kind that does not exist (``lookup("innerwrapper", ...)``)."""


class PluginLoadError(HpError, RuntimeError):
    """Strict mode: at least one plugin failed to load (``failures`` lists them)."""

    def __init__(self, message: str, failures: Sequence[PluginInfo] = ()) -> None:
        super().__init__(message)
        self.failures: tuple[PluginInfo, ...] = tuple(failures)
