"""Every plugin distribution in the repository has the same inside, so a newcomer who knows one
knows them all: ``pyproject.toml`` + ``LICENSE`` + ``src/<package>/`` (``__init__.py``, the hooks
in ``plugin.py``, ``py.typed``) + its own ``tests/``, and one ``hp_core`` entry point that names
``<package>.plugin``. The core keeps the top-level layout it was specified with."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DISTRIBUTIONS = [
    ROOT / "hp_plugin_cp",
    ROOT / "hp_plugin_moe",
    *sorted(d for d in (ROOT / "plugins").iterdir() if (d / "pyproject.toml").exists()),
]


def _layout_problems(dist: Path) -> list[str]:
    problems = []
    meta = tomllib.loads((dist / "pyproject.toml").read_text())
    package = meta["project"]["name"].replace("-", "_")
    for rel in (
        "LICENSE",
        f"src/{package}/__init__.py",
        f"src/{package}/plugin.py",
        f"src/{package}/py.typed",
    ):
        if not (dist / rel).is_file():
            problems.append(f"{dist.name}: missing {rel}")
    if not list((dist / "tests").glob("test_*.py")):
        problems.append(f"{dist.name}: no tests/test_*.py")
    points = meta["project"].get("entry-points", {}).get("hp_core", {})
    if list(points.values()) != [f"{package}.plugin"]:
        problems.append(f"{dist.name}: hp_core entry point {points} is not one '{package}.plugin'")
    if meta["tool"]["setuptools"]["packages"]["find"].get("where") != ["src"]:
        problems.append(f"{dist.name}: packages are not found under src/")
    return problems


def test_there_are_four_plugin_distributions() -> None:
    names = [d.name for d in PLUGIN_DISTRIBUTIONS]
    assert names == ["hp_plugin_cp", "hp_plugin_moe", "hp-plugin-bloom", "hp-plugin-phi3"]


@pytest.mark.parametrize("dist", PLUGIN_DISTRIBUTIONS, ids=lambda d: d.name)
def test_plugin_distribution_layout(dist: Path) -> None:
    assert _layout_problems(dist) == []


def test_the_layout_check_catches_a_missing_piece(tmp_path: Path) -> None:
    # Negative control: a copy of a plugin without its plugin.py and tests is refused.
    dist = tmp_path / "hp_plugin_cp"
    (dist / "src" / "hp_plugin_cp").mkdir(parents=True)
    for rel in (
        "pyproject.toml",
        "LICENSE",
        "src/hp_plugin_cp/__init__.py",
        "src/hp_plugin_cp/py.typed",
    ):
        (dist / rel).write_bytes((ROOT / "hp_plugin_cp" / rel).read_bytes())
    (dist / "tests").mkdir()
    assert _layout_problems(dist) == [
        "hp_plugin_cp: missing src/hp_plugin_cp/plugin.py",
        "hp_plugin_cp: no tests/test_*.py",
    ]


def test_the_core_keeps_its_top_level_layout() -> None:
    for rel in (
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "hp_core/__init__.py",
        "hp_core/py.typed",
        "tests",
        "hp_plugin_cp",
        "hp_plugin_moe",
        "plugins",
    ):
        assert (ROOT / rel).exists(), rel
