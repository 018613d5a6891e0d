"""Testing helpers for hp and for plugin authors: a reusable gloo world and tiny models."""

from __future__ import annotations

from hp_core.testing.world import (
    World,
    WorldError,
    WorldTaskError,
    WorldTimeoutError,
    get_world,
    shutdown_worlds,
)

__all__ = ["World", "WorldError", "WorldTaskError", "WorldTimeoutError", "get_world", "shutdown_worlds"]
