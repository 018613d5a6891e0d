"""Loads hp's pytest plugin in a checkout where hp-core's ``pytest11`` entry point is not
installed (yet); where it is, pytest has already loaded it as ``hp`` and this adds nothing.
"""

from __future__ import annotations

from importlib.metadata import entry_points

PLUGIN = "hp_core.testing.pytest_plugin"

pytest_plugins = (
    [] if any(ep.value == PLUGIN for ep in entry_points(group="pytest11")) else [PLUGIN]
)
