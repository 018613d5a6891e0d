"""``hp plugin new NAME``: the skeleton installs, ``hp plugins`` lists it, its tests pass.

One skeleton is generated, pip-installed (``--no-deps --target``, offline) into a temp
folder and used by every test of the module: ``hp plugins`` and the skeleton's own test
run (conformance suite + equivalence on 2 gloo ranks) happen in subprocesses whose
``PYTHONPATH`` starts with that folder. The negative control corrupts the installed copy
of its ``plugin.py`` (an undeclared item and a wrong role) and expects exactly the two
checks that guard those to fail.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from hp_core.cli import main
from hp_core.planner.structure import model_architectures
from hp_core.scaffold import ScaffoldError, check_name, hp_core_requirement, write_skeleton
from hp_core.version import __version__

ROOT = Path(__file__).resolve().parents[1]
NAME = "kit_demo"
DIST = "hp-plugin-kit-demo"
PACKAGE = "hp_plugin_kit_demo"
#: The skeleton's tests: 8 conformance checks (one equivalence case) + 1 rule test.
SKELETON_TESTS = 9
#: hp's pytest plugin for the skeleton's session: by ``-p`` unless hp-core's ``pytest11``
#: entry point is installed (then pytest loads it, and a second registration is refused).
PYTEST_HP = (
    []
    if any(ep.value == "hp_core.testing.pytest_plugin" for ep in entry_points(group="pytest11"))
    else ["-p", "hp_core.testing.pytest_plugin"]
)


def _env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HP_PLUGIN")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), *sys.path[1:]])
    env.pop("HP_DISABLE_PLUGIN_AUTOLOAD", None)
    return env


def _run(args: list[str], site: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=_env(site),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the generated folder, the site folder it is installed in)."""
    base = tmp_path_factory.mktemp("plugin_new")
    assert main(["plugin", "new", NAME, "--dir", str(base)]) == 0
    root, site = base / DIST, base / "site"
    pip = [
        "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q",
        "--target", str(site), str(root),
    ]  # fmt: skip
    done = _run(pip, site, base)
    assert done.returncode == 0, done.stderr
    return root, site


def _summary(out: str) -> dict[str, int]:
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", out)}


def test_the_skeleton_declares_what_it_registers(installed):
    root, _ = installed
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["name"] == DIST
    assert project["dependencies"] == [hp_core_requirement(__version__)]
    assert project["entry-points"]["hp_core"] == {NAME: f"{PACKAGE}.plugin"}
    assert project["entry-points"]["hp_core.items"] == {
        f"template.{NAME}.mlp_in": f"{PACKAGE}.plugin",
        f"template.{NAME}.mlp_out": f"{PACKAGE}.plugin",
    }
    assert (root / "src" / PACKAGE / "py.typed").is_file()


def test_hp_plugins_lists_it_with_its_items_and_distribution(installed):
    root, site = installed
    assert (site / PACKAGE / "py.typed").is_file()  # package data installed
    done = _run(["-m", "hp_core.cli", "plugins", "--strict"], site, root)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if f" {NAME} " in line]
    assert any(DIST in r and "loaded" in r and "│ 2 " in r for r in rows), done.stdout
    for item in ("mlp_in", "mlp_out"):
        (line,) = [r for r in done.stdout.splitlines() if f"{NAME}.{item} " in r]
        assert DIST in line and "architectures=TinyKitDemoModel" in line, line


def test_its_tests_pass_in_a_subprocess(installed):
    root, site = installed
    done = _run(
        ["-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *PYTEST_HP, "tests"], site, root
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert _summary(done.stdout) == {"passed": SKELETON_TESTS}, done.stdout[-2000:]
    assert "PASSED tests/test_conformance.py::TestConformance::test_equivalence[tp=2]" in (
        done.stdout
    )


def test_negative_control_an_undeclared_item_and_a_wrong_role_fail_their_checks(installed):
    root, site = installed
    plugin = site / PACKAGE / "plugin.py"
    original = plugin.read_text()
    corrupted = original.replace("Role.ROWWISE", "Role.COLWISE").replace(
        "        register(rule)\n",
        "        register(rule)\n"
        f'    register(RoleRule("{NAME}.extra", r"nothing$", Role.NORM, (ARCHITECTURE,)))\n',
    )
    assert corrupted.count("Role.COLWISE") == 2 and f"{NAME}.extra" in corrupted
    plugin.write_text(corrupted)
    try:
        done = _run(
            ["-m", "pytest", "-q", "-p", "no:cacheprovider", *PYTEST_HP, "-rf", "tests"], site, root
        )
    finally:
        plugin.write_text(original)
    assert _summary(done.stdout) == {"failed": 2, "passed": SKELETON_TESTS - 2}, done.stdout
    failed = sorted(re.findall(r"FAILED tests/(\S+)", done.stdout))
    assert failed == [
        "test_conformance.py::TestConformance::test_equivalence[tp=2]",
        "test_conformance.py::TestConformance::test_registers_exactly_the_declared_items",
    ]
    assert f"registered but not declared ['template.{NAME}.extra']" in done.stdout
    assert f"plugin '{NAME}' ({DIST}): equivalence case 'tp=2'" in done.stdout


def test_architecture_scopes_the_rules_and_the_tiny_model(tmp_path):
    assert main(["plugin", "new", "gpt", "--dir", str(tmp_path), "--architecture", "GPT2X"]) == 0
    root = tmp_path / "hp-plugin-gpt"
    modules = {}
    for name, path in (
        ("_skel_plugin", root / "src" / "hp_plugin_gpt" / "plugin.py"),
        ("_skel_tiny", root / "tests" / "tiny_model.py"),
    ):
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[name])
    plugin, tiny = modules["_skel_plugin"], modules["_skel_tiny"]
    model = tiny.build()
    assert plugin.ARCHITECTURE == "GPT2X" and model_architectures(model) == ("GPT2X",)
    names = [n for n, _ in model.named_parameters()]
    claimed = {r.name: [n for n in names if r.matches(n, ("GPT2X",))] for r in plugin.ROLE_RULES}
    assert claimed == {
        "gpt.mlp_in": [f"layers.{i}.mlp.fc_in.{p}" for i in (0, 1) for p in ("weight", "bias")],
        "gpt.mlp_out": ["layers.0.mlp.fc_out.weight", "layers.1.mlp.fc_out.weight"],
    }
    again = tiny.build()
    assert all(a.equal(b) for a, b in zip(model.parameters(), again.parameters(), strict=True))


# ------------------------------------------------------------------ usage errors


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [("My-GPT", "my_gpt"), ("9lives", "p9lives"), ("hp_plugin_x", "x"), ("class", "my_class")],
)
def test_a_bad_name_is_a_usage_error_with_a_fix(tmp_path, capsys, name, suggestion):
    assert main(["plugin", "new", name, "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"hp plugin new: error: plugin name {name!r}" in err and "Fix:" in err, err
    assert f"'{suggestion}'" in err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ScaffoldError):
        check_name(name)


def test_an_existing_folder_needs_force(tmp_path, capsys):
    assert main(["plugin", "new", "demo", "--dir", str(tmp_path)]) == 0
    root = tmp_path / "hp-plugin-demo"
    (root / "NOTES.txt").write_text("mine")
    (root / "README.md").write_text("edited")
    assert main(["plugin", "new", "demo", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "Fix: pass --force" in err
    assert (root / "README.md").read_text() == "edited"
    assert main(["plugin", "new", "demo", "--dir", str(tmp_path), "--force"]) == 0
    assert (root / "README.md").read_text().startswith("# hp-plugin-demo")
    assert (root / "NOTES.txt").read_text() == "mine"  # --force leaves other files alone


def test_a_file_in_the_way_is_refused_even_with_force(tmp_path):
    (tmp_path / "hp-plugin-demo").write_text("")
    with pytest.raises(ScaffoldError, match=r"not a folder.*Fix:"):
        write_skeleton("demo", tmp_path, force=True)


def test_a_bad_architecture_is_a_usage_error(tmp_path, capsys):
    assert main(["plugin", "new", "demo", "--dir", str(tmp_path), "--architecture", "x-y"]) == 2
    assert "is not a class name" in capsys.readouterr().err


def test_plugin_without_an_action_and_new_without_a_name_exit_2(capsys):
    assert main(["plugin"]) == 2
    assert "hp plugin [-h] ACTION" in capsys.readouterr().err
    assert main(["plugin", "new"]) == 2
    assert "NAME" in capsys.readouterr().err


def test_the_hp_core_range_is_one_minor_release():
    assert hp_core_requirement("0.1.0") == "hp-core>=0.1,<0.2"
    assert hp_core_requirement("1.12.3.dev1") == "hp-core>=1.12,<1.13"
