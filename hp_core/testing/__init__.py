"""Testing helpers for hp and for plugin authors: a reusable gloo world and tiny models.

The tiny models are :mod:`hp_core.presets`' (re-exported here); the differential-test
families are in :mod:`hp_core.testing.families` and :mod:`hp_core.testing.family_matrix`.
"""

from __future__ import annotations

from hp_core.presets import FAMILIES, build_model, tiny_config
from hp_core.testing.sandbox import PluginSandbox
from hp_core.testing.world import (
    World,
    WorldError,
    WorldTaskError,
    WorldTimeoutError,
    get_world,
    shutdown_worlds,
)

__all__ = [
    "FAMILIES",
    "PluginSandbox",
    "World",
    "WorldError",
    "WorldTaskError",
    "WorldTimeoutError",
    "build_model",
    "get_world",
    "shutdown_worlds",
    "tiny_config",
]
