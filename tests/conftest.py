"""Shared fixtures. Worlds, import paths and OMP_NUM_THREADS come from hp's pytest plugin
(hp_core.testing.pytest_plugin), loaded by its entry point or the root conftest.py."""

from __future__ import annotations

import pytest


@pytest.fixture
def plugin_env(monkeypatch):
    """No plugin-related environment from outside; plugins rediscovered after the test."""
    from hp_core.plugins import reset_plugins
    from tests._plugin_fakes import clean_plugin_env

    clean_plugin_env(monkeypatch)
    yield
    reset_plugins()


@pytest.fixture
def fakes(tmp_path):
    """Fake plugin distributions installed under tmp_path (see tests/_plugin_fakes.py)."""
    from tests._plugin_fakes import FakePlugins

    with FakePlugins(tmp_path / "site") as fake:
        yield fake
