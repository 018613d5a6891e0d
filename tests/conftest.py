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
