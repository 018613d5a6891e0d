"""Fake plugin distributions for tests: a ``*.dist-info`` + modules in a tmp dir on sys.path.

``importlib.metadata`` finds a distribution through any ``<name>-<version>.dist-info``
folder on ``sys.path``, so writing one (METADATA + entry_points.txt) is enough to make a
plugin appear, and taking the folder off ``sys.path`` makes it disappear, without pip.
"""

from __future__ import annotations

import importlib
import itertools
import sys
import textwrap
from pathlib import Path

import pytest

from hp_core.plugins import (
    ENV_DISABLE_AUTOLOAD,
    ENV_IMPORT_TIMEOUT,
    ENV_PLUGINS,
    ENV_STRICT,
    reset_plugins,
)

_COUNTER = itertools.count()

HEADER = """\
from hp_core.hookspecs import hookimpl
from hp_core.injection import inner_wrapper, local_compute

HP_PLUGIN_API = 2

@inner_wrapper
def good_wrapper(target_module, ctx):
    return None

@local_compute
def good_factory(ctx, capacity=1.0):
    return None

def undecorated(target_module, ctx):
    return None
"""


def clean_plugin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No HP_* plugin switches from the outer environment; fresh discovery before and after."""
    for var in (ENV_DISABLE_AUTOLOAD, ENV_PLUGINS, ENV_STRICT, ENV_IMPORT_TIMEOUT):
        monkeypatch.delenv(var, raising=False)
    reset_plugins()


class FakePlugins:
    """Writes fake plugin distributions into ``root`` and puts ``root`` on ``sys.path``."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.monkeypatch = monkeypatch
        self.modules: list[str] = []
        self.on_path = False

    def add_distribution(
        self,
        dist: str,
        entry_points: dict[str, str],
        *,
        version: str = "0.1",
        modules: dict[str, str] | None = None,
        record: list[str] | None = None,
        items: dict[str, str] | None = None,
    ) -> Path:
        """``items``: the ``hp_core.items`` entries (``"<kind>.<name>": module``)."""
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
        declared = "".join(f"{name} = {value}\n" for name, value in (items or {}).items())
        extra = f"\n[hp_core.items]\n{declared}" if items is not None else ""
        (info / "entry_points.txt").write_text(f"[hp_core]\n{lines}{extra}")
        if record is not None:
            (info / "RECORD").write_text("".join(f"{path},,\n" for path in record))
        for module, source in (modules or {}).items():
            path = self.root / (module.replace(".", "/") + ".py")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))
            self.modules.append(module)
        self.enable()
        return info

    def plugin(self, name: str, body: str, *, dist: str | None = None, version: str = "0.1") -> str:
        """A one-module plugin (entry point ``name``) with ``HEADER`` + ``body``; returns the
        module."""
        module = f"fake_{name}_{next(_COUNTER)}"
        self.add_distribution(
            dist or f"fake-{name}",
            {name: module},
            version=version,
            modules={module: HEADER + textwrap.dedent(body)},
        )
        return module

    def enable(self) -> None:
        if not self.on_path:
            self.monkeypatch.syspath_prepend(str(self.root))
            self.on_path = True
        reset_plugins()

    def disable(self) -> None:
        if self.on_path:
            sys.path.remove(str(self.root))
            importlib.invalidate_caches()
            self.on_path = False
        reset_plugins()

    def cleanup(self) -> None:
        for module in self.modules:
            sys.modules.pop(module, None)
