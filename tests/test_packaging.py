"""Distributions: pins, dependencies, entry points, and imports from the repository root."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECTS = sorted([ROOT / "pyproject.toml", *ROOT.glob("hp_plugin_*/pyproject.toml"), *ROOT.glob("plugins/*/pyproject.toml")])
PLUGIN_DISTS = {"hp-plugin-cp": ("hp_plugin_cp", "cp"), "hp-plugin-moe": ("hp_plugin_moe", "moe")}


def _requirements(pyproject: Path) -> list[str]:
    data = tomllib.loads(pyproject.read_text())
    project = data["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs.extend(extra)
    reqs.extend(data.get("build-system", {}).get("requires", []))
    return reqs


def test_every_distribution_is_found():
    names = {tomllib.loads(p.read_text())["project"]["name"] for p in PYPROJECTS}
    assert {"hp-core", "hp-plugin-cp", "hp-plugin-moe", "hp-plugin-phi3"} <= names


@pytest.mark.parametrize("pyproject", PYPROJECTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_torch_is_pinned_wherever_named(pyproject):
    for req in _requirements(pyproject):
        if re.match(r"^\s*torch\b(?![-_.\w])", req):
            assert req.replace(" ", "") == "torch==2.13.0", f"{pyproject}: {req!r} must be exactly torch==2.13.0"


@pytest.mark.parametrize("pyproject", [p for p in PYPROJECTS if p != ROOT / "pyproject.toml"], ids=lambda p: p.parent.name)
def test_plugins_depend_on_hp_core_only(pyproject):
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0] for d in deps}
    assert names <= {"hp-core", "torch"} and "hp-core" in names


def test_core_never_imports_a_plugin():
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "hp_core").rglob("*.py")
        if re.search(r"^\s*(from|import)\s+hp_plugin_", p.read_text(), re.MULTILINE)
    ]
    assert offenders == []


@pytest.mark.parametrize("dist,pkg", [(d, v[0]) for d, v in PLUGIN_DISTS.items()])
def test_installed_plugin_entry_points(dist, pkg):
    d = metadata.distribution(dist)
    eps = [ep for ep in d.entry_points if ep.group == "hp_core"]
    assert [ep.name for ep in eps] == [PLUGIN_DISTS[dist][1]]
    assert eps[0].value.split(".")[0] == pkg
    assert any(str(f).endswith("py.typed") for f in (d.files or [])) or (ROOT / dist.replace("-", "_")).exists()


def test_repository_root_imports_the_installed_packages():
    """From the root, a plugin folder must not shadow the installed package as a namespace package."""
    code = (
        "import hp_core, hp_plugin_cp, hp_plugin_moe, hp_plugin_phi3;"
        "print(hp_core.__file__); print(hp_plugin_cp.__file__); print(hp_plugin_moe.__file__);"
        "print(hp_plugin_phi3.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == str(ROOT / "hp_core" / "__init__.py")
    assert out[1] == str(ROOT / "hp_plugin_cp" / "src" / "hp_plugin_cp" / "__init__.py")
    assert out[2] == str(ROOT / "hp_plugin_moe" / "src" / "hp_plugin_moe" / "__init__.py")
    assert out[3] == str(ROOT / "plugins" / "hp-plugin-phi3" / "src" / "hp_plugin_phi3" / "__init__.py")


def test_packages_are_typed():
    for folder in (ROOT / "hp_core", ROOT / "hp_plugin_cp/src/hp_plugin_cp", ROOT / "hp_plugin_moe/src/hp_plugin_moe"):
        assert (folder / "py.typed").exists(), folder
