"""Fixtures of the hp-plugin-cp tests.

The rank-side tasks live in ``_cp_rank_tasks.py`` next to this file: pytest puts this
folder on ``sys.path`` (the tests are not a package), and the shared gloo worlds copy
``sys.path`` into their ranks, so the ranks import the tasks by the same name.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _close_worlds_at_session_end():
    """Stop the gloo ranks before coverage is combined, so their measurements are written."""
    yield
    from hp_core.testing import shutdown_worlds

    shutdown_worlds()


@pytest.fixture
def plugins_env(monkeypatch):
    """No HP_* plugin switches from outside; fresh discovery before and after the test."""
    from hp_core.plugins import ENV_DISABLE_AUTOLOAD, ENV_PLUGINS, ENV_STRICT, reset_plugins

    for var in (ENV_DISABLE_AUTOLOAD, ENV_PLUGINS, ENV_STRICT):
        monkeypatch.delenv(var, raising=False)
    reset_plugins()
    yield monkeypatch
    reset_plugins()
