"""Shared fixtures. Worlds, import paths and OMP_NUM_THREADS come from hp's pytest plugin
(hp_core.testing.pytest_plugin), loaded by its entry point or the root conftest.py."""

from __future__ import annotations

import pytest
from transformers.utils import logging as hf_logging

# transformers gives its root logger a StreamHandler on sys.stderr the first time a logger is
# asked for. Asked for first inside a test with capsys, that handler keeps the test's capture
# stream, which is closed afterwards, and every later transformers warning (a kernel falling
# back, once per process) prints "--- Logging error ---" into whichever test is running. Asked
# for here, the handler holds pytest's session-wide stderr.
hf_logging.get_logger("transformers")


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
