"""Fixtures of hp-plugin-moe's tests.

The rank-side task modules (``moe_tasks``, ``moe_toys``) live next to the tests; their
folder is put on ``sys.path`` at collection time, before any gloo world is spawned, so
the spawned ranks (which copy ``sys.path``) can import them too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _close_worlds_at_session_end():
    """Stop the gloo ranks before coverage is combined, so their measurements are written."""
    yield
    from hp_core.testing import shutdown_worlds

    shutdown_worlds()
