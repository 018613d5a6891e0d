"""Shared fixtures. Distributed worlds are spawned once per session (hp_core.testing.get_world)."""

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
def plugin_env(monkeypatch):
    """No plugin-related environment from outside; plugins rediscovered after the test."""
    from hp_core.plugins import reset_plugins
    from tests._plugin_fakes import clean_plugin_env

    clean_plugin_env(monkeypatch)
    yield
    reset_plugins()


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """Fake plugin distributions installed under tmp_path (see tests/_plugin_fakes.py)."""
    from tests._plugin_fakes import FakePlugins

    fake = FakePlugins(tmp_path / "site", monkeypatch)
    yield fake
    fake.cleanup()
