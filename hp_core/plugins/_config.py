"""Names and environment switches of the plugin system (no state, no imports of hp)."""

from __future__ import annotations

import math
import os

from hp_core.hookspecs import PROJECT_NAME

__all__ = [
    "BUILTIN_PLUGIN_MODULE",
    "BUILTIN_PLUGIN_NAME",
    "CORE_DISTRIBUTION",
    "DEFAULT_IMPORT_TIMEOUT",
    "ENTRY_POINT_GROUP",
    "ENV_DISABLE_AUTOLOAD",
    "ENV_IMPORT_TIMEOUT",
    "ENV_PLUGINS",
    "ENV_STRICT",
    "env_true",
    "import_timeout_from_env",
    "strict_from_env",
]

#: The entry-point group plugins are discovered in (the pluggy project name).
ENTRY_POINT_GROUP = PROJECT_NAME
#: Name of the core's own plugin, which registers the default templates and role rules.
BUILTIN_PLUGIN_NAME = "builtin"
#: The module of the built-in plugin, loaded by name like an entry point: it lives in the
#: planner layer that owns those templates, above this one.
BUILTIN_PLUGIN_MODULE = "hp_core.planner.builtin_plugin"
CORE_DISTRIBUTION = "hp-core"
ENV_DISABLE_AUTOLOAD = "HP_DISABLE_PLUGIN_AUTOLOAD"
ENV_PLUGINS = "HP_PLUGINS"
ENV_STRICT = "HP_PLUGINS_STRICT"
ENV_IMPORT_TIMEOUT = "HP_PLUGIN_IMPORT_TIMEOUT"
#: Seconds one plugin's import may take before it is reported as failed.
DEFAULT_IMPORT_TIMEOUT = 10.0
_UNBOUNDED = {"0", "off", "none", "inf"}
_TRUE = {"1", "true", "yes", "on"}


def env_true(name: str) -> bool:
    """Whether environment variable ``name`` is set to a true value (``1``, ``yes``, ...)."""
    return os.environ.get(name, "").strip().lower() in _TRUE


def strict_from_env() -> bool:
    """Whether ``HP_PLUGINS_STRICT`` asks for strict plugin loading."""
    return env_true(ENV_STRICT)


def import_timeout_from_env() -> tuple[float | None, str | None]:
    """``(seconds or None for no bound, warning or None)`` from ``HP_PLUGIN_IMPORT_TIMEOUT``.

    Unset or empty: :data:`DEFAULT_IMPORT_TIMEOUT`. ``0``, ``off``, ``none``, ``inf``: no
    bound. Anything else that is not a positive number: the default, with a warning.
    """
    raw = os.environ.get(ENV_IMPORT_TIMEOUT)
    if raw is None or not raw.strip():
        return DEFAULT_IMPORT_TIMEOUT, None
    text = raw.strip().lower()
    if text in _UNBOUNDED:
        return None, None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isinf(value) and value > 0:
        return None, None
    if not math.isfinite(value) or value <= 0:
        return DEFAULT_IMPORT_TIMEOUT, (
            f"{ENV_IMPORT_TIMEOUT}={raw!r} is not a number of seconds; using "
            f"{DEFAULT_IMPORT_TIMEOUT:g} s. Set it to a positive number, or to 0 for no limit."
        )
    return value, None
