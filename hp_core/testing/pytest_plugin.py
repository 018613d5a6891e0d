"""hp's pytest plugin (entry point ``pytest11: hp``): worlds, a plugin sandbox, import paths.

Installed with hp-core, pytest loads it in every session (``-p no:hp`` turns it off):

* ``hp_world`` (session scope): ``hp_world(n=2)`` is the session's shared gloo
  :class:`~hp_core.testing.World` of ``n`` ranks (:func:`~hp_core.testing.get_world`).
* ``hp_plugins`` (function scope): a :class:`~hp_core.testing.PluginSandbox`, closed
  after the test, so nothing it installed or switched leaks into the next one.
* Collection puts the rootdir and the folder of every collected test module and conftest
  on ``sys.path`` (appended, so they never shadow an installed module). Spawned ranks copy
  ``sys.path``, so they import rank-task modules next to the tests by name, in pytest's
  ``prepend`` and ``importlib`` import modes alike.
* The worlds shut down when the session's last fixture is torn down, which is before
  pytest-cov stops measuring and combines the data (its ``pytest_runtestloop`` wrapper
  ends before ``pytest_sessionfinish``), so the ranks' coverage files are written in time.
  ``pytest_sessionfinish`` shuts down any world spawned outside a test.
* ``OMP_NUM_THREADS`` defaults to 1 (the ranks of a world share the machine's cores).
* Registers the ``distributed`` marker.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from hp_core.errors import HpError
from hp_core.testing.sandbox import PluginSandbox
from hp_core.testing.world import World, get_world, shutdown_worlds

__all__ = ["HpWorldSizeError", "add_import_path", "added_import_paths"]

_ADDED: list[str] = []


class HpWorldSizeError(HpError, ValueError):
    """``hp_world(n)`` got a world size that is not a positive int."""


def add_import_path(folder: Path | str) -> None:
    """Append ``folder`` to ``sys.path`` once (the ranks of worlds spawned later see it)."""
    entry = str(Path(folder).resolve())
    if entry not in sys.path:
        sys.path.append(entry)
        _ADDED.append(entry)


def added_import_paths() -> list[str]:
    """The folders this plugin appended to ``sys.path`` in this process, in order."""
    return list(_ADDED)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "distributed: spawns real gloo process groups")
    if "OMP_NUM_THREADS" not in os.environ:
        # torch is already imported (by hp_core), so its pool no longer reads the variable.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_sessionstart(session: pytest.Session) -> None:
    add_import_path(session.config.rootpath)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> None:
    name = file_path.name
    if not name.endswith(".py"):
        return
    patterns = parent.config.getini("python_files")
    if name == "conftest.py" or any(fnmatch.fnmatch(name, p) for p in patterns):
        add_import_path(file_path.parent)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_worlds()


@pytest.fixture(scope="session", autouse=True)
def _hp_shutdown_worlds() -> Iterator[None]:
    """Stops every world at the end of the test loop, while coverage still collects."""
    yield
    shutdown_worlds()


@pytest.fixture(scope="session")
def hp_world() -> Callable[..., World]:
    """``hp_world(n=2)``: the session's shared gloo world of ``n`` ranks."""

    def world(n: int = 2) -> World:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise HpWorldSizeError(
                f"hp_world({n!r}): the world size must be a positive int (the number of "
                "ranks). Fix: call hp_world(2) (or the product of your mesh's axis sizes)."
            )
        return get_world(n)

    return world


@pytest.fixture
def hp_plugins(tmp_path: Path) -> Iterator[PluginSandbox]:
    """A :class:`PluginSandbox` in ``tmp_path``; everything it did is undone after the test."""
    sandbox = PluginSandbox(tmp_path / "hp-plugins")
    try:
        yield sandbox
    finally:
        sandbox.close()
