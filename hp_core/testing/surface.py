"""hp-core's public surface for plugins, and the source check that a plugin keeps to it.

A plugin imports from hp-core only the modules in :data:`PUBLIC_SURFACE`; everything else
(``hp_core.planner``, ``hp_core.plugins._items``, ...) is private and may change in any
release. :func:`private_hp_imports` reads a package's source with :mod:`ast` (every
``import`` and ``from ... import``, inside functions and ``TYPE_CHECKING`` blocks too,
without importing the package) and lists each import of a private hp-core module or name.
The conformance suite (:mod:`hp_core.testing.conformance`) and hp's own layer test run it.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

__all__ = ["PUBLIC_SURFACE", "package_files", "private_hp_imports"]

#: The hp-core modules a plugin may import (their public names).
PUBLIC_SURFACE: tuple[str, ...] = (
    "hp_core",
    "hp_core.hookspecs",
    "hp_core.injection",
    "hp_core.collectives",
    "hp_core.context",
    "hp_core.plugins",
    "hp_core.testing",
)

_CORE = "hp_core"


def package_files(root: Path) -> list[Path]:
    """The ``.py`` files of a package folder (or the one file of a single-module package)."""
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _is_module(name: str) -> bool:
    """Whether ``hp_core.x.y`` names a module (found without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _check(module: str, names: list[str]) -> list[str]:
    """The private parts of one import of ``module`` (and ``names`` from it)."""
    if module != _CORE and not module.startswith(_CORE + "."):
        return []
    if module not in PUBLIC_SURFACE:
        return [f"module {module}"]
    bad = []
    for name in names:
        if name.startswith("_"):
            bad.append(f"private name {module}.{name}")
        elif f"{module}.{name}" not in PUBLIC_SURFACE and _is_module(f"{module}.{name}"):
            bad.append(f"module {module}.{name}")
    return bad


def private_hp_imports(root: Path) -> list[str]:
    """Every import of a private hp-core module or name in the package at ``root``.

    ``root`` is the package folder (or a module file). Each entry reads
    ``path:line imports module hp_core.planner.templates``; an empty list means the
    package keeps to :data:`PUBLIC_SURFACE`.
    """
    found: list[str] = []
    for path in package_files(root):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            checks: list[tuple[str, list[str]]] = []
            if isinstance(node, ast.Import):
                checks = [(alias.name, []) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                checks = [(node.module, [alias.name for alias in node.names])]
            else:
                continue
            for module, names in checks:
                found.extend(f"{path}:{node.lineno} imports {bad}" for bad in _check(module, names))
    return found
