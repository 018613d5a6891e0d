"""Loads hp's pytest plugin for this repository's own test sessions.

``pyproject.toml``'s ``addopts`` blocks the installed entry point (``-p no:hp``) and this
conftest loads the same module instead: a conftest is imported after pytest-cov has started
measuring, an entry-point plugin before, so only this way is the plugin's own code measured
by ``make test``. Everywhere else (a plugin author's tests) the entry point loads it.
"""

from __future__ import annotations

pytest_plugins = ["hp_core.testing.pytest_plugin"]
