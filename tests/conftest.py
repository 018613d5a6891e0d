"""Shared fixtures. Distributed worlds are spawned once per session (hp_core.testing.get_world)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
