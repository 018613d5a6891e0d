"""Distributions: version ranges, extras, licenses, entry points, and imports from the repository
root.

The built wheels themselves (their metadata, a fresh environment installed from them) are
checked by tests/test_wheels.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PYPROJECTS = sorted(
    [
        ROOT / "pyproject.toml",
        *ROOT.glob("hp_plugin_*/pyproject.toml"),
        *ROOT.glob("plugins/*/pyproject.toml"),
    ]
)
PLUGIN_DISTS = {"hp-plugin-cp": ("hp_plugin_cp", "cp"), "hp-plugin-moe": ("hp_plugin_moe", "moe")}
TORCH = "2.13.0"  # the one torch the Makefile (and so CI) installs
CORE = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _bounded_above(req: Requirement) -> bool:
    return bool(req.specifier) and not req.specifier.contains("999", prereleases=True)


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
    assert {
        "hp-core",
        "hp-plugin-cp",
        "hp-plugin-moe",
        "hp-plugin-phi3",
        "hp-plugin-bloom",
    } <= names


@pytest.mark.parametrize("pyproject", PYPROJECTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_torch_range_wherever_named_includes_the_installed_torch(pyproject):
    """Metadata declares a compatible range (it must contain 2.13.0 and stop before an untested
    minor)."""
    for raw in _requirements(pyproject):
        req = Requirement(raw)
        if req.name == "torch":
            assert req.specifier.contains(TORCH), f"{pyproject}: {raw!r} excludes torch {TORCH}"
            assert _bounded_above(req), f"{pyproject}: {raw!r} needs an upper bound"
            assert not req.specifier.contains("2.12.0") and not req.specifier.contains("2.14.0"), (
                raw
            )


def test_core_declares_torch():
    assert [r for r in map(Requirement, CORE["dependencies"]) if r.name == "torch"]


def test_makefile_installs_exactly_the_pinned_torch():
    """The range is for users; the Makefile (what CI runs) installs exactly one torch, and checks
    it."""
    makefile = (ROOT / "Makefile").read_text()
    named = re.findall(r"[\"']torch\b([^\"']*)[\"']", makefile)
    assert named and all(spec.replace(" ", "") == f"=={TORCH}" for spec in named), named
    # every pip install in the Makefile carries the pin, so no step can pull another torch
    installs = [
        line for line in makefile.replace("\\\n", " ").splitlines() if "pip install" in line
    ]
    assert installs and all(f'"torch=={TORCH}"' in line for line in installs), installs
    assert f"torch.__version__.startswith('{TORCH}')" in makefile


@pytest.mark.parametrize(
    "pyproject",
    [p for p in PYPROJECTS if p != ROOT / "pyproject.toml"],
    ids=lambda p: p.parent.name,
)
def test_plugins_depend_on_hp_core_only(pyproject):
    """Each plugin needs hp-core in a compatible range: the current version, not the next minor
    (pre-1.0)."""
    reqs = [Requirement(d) for d in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]
    assert {r.name for r in reqs} <= {"hp-core", "torch"}
    (core,) = [r for r in reqs if r.name == "hp-core"]
    version = Version(CORE["version"])
    assert core.specifier.contains(version), f"{pyproject}: {core} excludes hp-core {version}"
    assert not core.specifier.contains(f"{version.major}.{version.minor + 1}.0"), (
        f"{pyproject}: {core} allows the next minor"
    )
    assert _bounded_above(core)


def test_transformers_is_the_hf_extra():
    """transformers is optional (hp-core[hf]); the test extra still brings it (the suite builds HF
    models)."""
    assert "transformers" not in {Requirement(d).name for d in CORE["dependencies"]}
    extras = CORE["optional-dependencies"]
    (hf,) = [Requirement(d) for d in extras["hf"]]
    assert hf.name == "transformers" and str(hf.specifier) == str(
        Requirement("transformers>=5.0,<6").specifier
    )
    (transformers, accelerate) = [Requirement(d) for d in extras["trainer"]]  # HpTrainer
    assert (transformers.name, transformers.specifier, accelerate.name) == (
        "transformers",
        hf.specifier,
        "accelerate",
    )
    test = [Requirement(d) for d in extras["test"]]
    assert any(r.name == "accelerate" for r in test), extras["test"]
    assert any(r.name == "transformers" and r.specifier == hf.specifier for r in test) or any(
        r.name == "hp-core" and "hf" in r.extras for r in test
    ), extras["test"]
    assert {"pytest", "pytest-cov", "pytest-timeout", "ruff"} <= {r.name for r in test}


@pytest.mark.parametrize("pyproject", PYPROJECTS, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_spdx_license_and_license_file(pyproject):
    """PEP 639: an SPDX expression and the license text next to each pyproject (each dist builds
    from its dir)."""
    data = tomllib.loads(pyproject.read_text())
    assert data["project"]["license"] == "Apache-2.0"
    assert data["project"]["license-files"] == ["LICENSE"]
    text = (pyproject.parent / "LICENSE").read_text()
    assert (
        "Apache License" in text
        and "Version 2.0, January 2004" in text
        and "END OF TERMS AND CONDITIONS" in text
    )
    assert not any(
        c.startswith("License ::") for c in data["project"].get("classifiers", [])
    )  # superseded by PEP 639
    (setuptools,) = [
        Requirement(r)
        for r in data["build-system"]["requires"]
        if Requirement(r).name == "setuptools"
    ]
    assert not setuptools.specifier.contains("76.9") and setuptools.specifier.contains("77.0"), (
        setuptools
    )


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
    assert (
        any(str(f).endswith("py.typed") for f in (d.files or []))
        or (ROOT / dist.replace("-", "_")).exists()
    )


def test_repository_root_imports_the_installed_packages():
    """From the root, a plugin folder must not shadow the installed package as a namespace
    package."""
    code = (
        "import hp_core, hp_plugin_cp, hp_plugin_moe, hp_plugin_phi3;"
        "print(hp_core.__file__); print(hp_plugin_cp.__file__); print(hp_plugin_moe.__file__);"
        "print(hp_plugin_phi3.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == str(ROOT / "hp_core" / "__init__.py")
    assert out[1] == str(ROOT / "hp_plugin_cp" / "src" / "hp_plugin_cp" / "__init__.py")
    assert out[2] == str(ROOT / "hp_plugin_moe" / "src" / "hp_plugin_moe" / "__init__.py")
    assert out[3] == str(
        ROOT / "plugins" / "hp-plugin-phi3" / "src" / "hp_plugin_phi3" / "__init__.py"
    )


def test_packages_are_typed():
    for folder in (
        ROOT / "hp_core",
        ROOT / "hp_plugin_cp/src/hp_plugin_cp",
        ROOT / "hp_plugin_moe/src/hp_plugin_moe",
    ):
        assert (folder / "py.typed").exists(), folder
