"""Fake plugin distributions for hp's own tests, on hp_core.testing's PluginSandbox.

:class:`FakePlugins` adds what these tests need on top of the public sandbox: one-module
plugins built from ``HEADER`` and a list of the modules written, so a test can forget
their imports (``cleanup``) without uninstalling the distributions.
"""

from __future__ import annotations

import itertools
import sys
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from hp_core.plugins import reset_plugins
from hp_core.testing import PluginSandbox
from hp_core.testing.sandbox import PLUGIN_ENV_VARS

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
    for var in PLUGIN_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    reset_plugins()


class FakePlugins(PluginSandbox):
    """A :class:`PluginSandbox` in ``root`` that remembers the modules it wrote."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.modules: list[str] = []

    def add_distribution(
        self,
        dist: str,
        entry_points: Mapping[str, str],
        *,
        version: str = "0.1",
        modules: Mapping[str, str] | None = None,
        items: Mapping[str, str] | None = None,
        record: Iterable[str] | None = None,
    ) -> Path:
        info = super().add_distribution(
            dist, entry_points, version=version, modules=modules, items=items, record=record
        )
        self.modules.extend(modules or {})
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

    def cleanup(self) -> None:
        """Forget the imports of the written modules (the distributions stay installed)."""
        for module in self.modules:
            sys.modules.pop(module, None)
