"""Fixtures of the hp-plugin-cp tests.

The rank-side tasks live in ``_cp_rank_tasks.py`` next to this file; hp's pytest plugin
puts this folder on ``sys.path`` at collection, so the spawned ranks import them by name,
and shuts the worlds down at session end.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def plugins_env(hp_plugins, monkeypatch):
    """No HP_* plugin switches from outside; fresh discovery before and after the test
    (hp's ``hp_plugins`` sandbox); yields ``monkeypatch`` for the test's own switches."""
    return monkeypatch
