"""`hp plugins`: the two tables, --strict, warnings, the console script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hp_core import cli
from tests._plugin_fakes import FakePlugins

pytestmark = pytest.mark.usefixtures("plugin_env")


@pytest.fixture
def broken(tmp_path):
    with FakePlugins(tmp_path / "site") as fake:
        fake.add_distribution("fake-broken", {"broken": "fake_cli_missing_module"}, version="2.5")
        yield fake


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["plugins", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def row(out: str, first: str) -> list[str]:
    """The cells of the table row whose first cell is ``first``."""
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in:\n{out}")


def test_lists_plugins_and_items_with_providers(capsys):
    code, out, err = run(capsys)
    assert code == 0, err
    assert "hp plugins" in out and "registered items" in out
    assert row(out, "builtin")[:4] == ["builtin", "hp-core", "0.1.0", "builtin"]
    assert row(out, "cp")[:4] == ["cp", "hp-plugin-cp", "0.1.0", "loaded"]
    assert row(out, "moe")[:4] == ["moe", "hp-plugin-moe", "0.1.0", "loaded"]
    embed = row(out, "template")  # first template row: the built-in's first rule
    assert embed[2:4] == ["builtin", "hp-core"]
    assert "phi3.fused_qkv" in out and "architectures=Phi3ForCausalLM" in out
    assert err == ""


def test_items_show_their_static_requirements(capsys):
    from hp_core.injection import inner_wrapper
    from hp_core.plugins import register_inner_wrapper

    @inner_wrapper
    def w(target_module, ctx):
        return None

    register_inner_wrapper(
        "cli_wrapper", w, needs_cp=True, region_dispatch=False, forward_style="hf"
    )
    _, out, _ = run(capsys)
    cells = next(c for c in out.splitlines() if "cli_wrapper" in c)
    assert "inner_wrapper" in cells and "user" in cells
    assert "needs_cp=True region_dispatch=False forward_style=hf" in cells


def test_broken_plugin_is_listed_and_only_strict_fails(capsys, broken):
    code, out, _ = run(capsys)
    assert code == 0
    cells = row(out, "broken")
    assert cells[1:4] == ["fake-broken", "2.5", "failed"]
    assert "fake_cli_missing_module" in out
    assert row(out, "cp")[3] == "loaded"

    code, out, err = run(capsys, "--strict")
    assert code == 1
    assert (
        "hp plugins --strict: plugin 'broken' from distribution fake-broken 2.5 failed to load"
        in err
    )
    assert "ModuleNotFoundError" in err
    assert row(out, "broken")[3] == "failed"  # the tables are still printed


def test_strict_env_fails_like_the_flag(capsys, broken, monkeypatch):
    monkeypatch.setenv("HP_PLUGINS_STRICT", "1")
    code, _, err = run(capsys)
    assert code == 1 and "plugin 'broken'" in err


def test_strict_passes_when_nothing_is_broken(capsys):
    assert run(capsys, "--strict")[0] == 0


def test_unknown_hp_plugins_name_is_a_warning_line(capsys, monkeypatch):
    monkeypatch.setenv("HP_PLUGINS", "cpp")
    with pytest.warns(UserWarning):
        code, out, err = run(capsys)
    assert code == 0
    assert "warning: HP_PLUGINS names plugin 'cpp'" in err and "Did you mean 'cp'?" in err
    assert row(out, "cp")[3] == "disabled"
    assert run(capsys, "--strict")[0] == 1


def test_usage(capsys):
    assert cli.main([]) == 2
    assert "plugins" in capsys.readouterr().err
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("hp ")
    assert cli.main(["no-such-command"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert cli.main(["plugins", "--help"]) == 0
    assert "--strict" in capsys.readouterr().out


def test_console_script(tmp_path):
    hp = shutil.which("hp", path=str(Path(sys.executable).parent)) or shutil.which("hp")
    assert hp, "the hp console script is not installed: pip install -e ."
    env = {k: v for k, v in os.environ.items() if not k.startswith("HP_")}
    env["PYTHONPATH"] = ""  # the console script must find everything through the install
    proc = subprocess.run(
        [hp, "plugins"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert row(proc.stdout, "cp")[:2] == ["cp", "hp-plugin-cp"]
    assert row(proc.stdout, "moe")[:2] == ["moe", "hp-plugin-moe"]
