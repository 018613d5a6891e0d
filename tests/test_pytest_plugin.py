"""hp's pytest plugin: hp_world, hp_plugins (the PluginSandbox), rank import paths, session end.

Inner pytest sessions (pytester) run in a temp folder with no conftest, so only the plugin
can provide what they use. Those that spawn a world run in a subprocess: in-process, their
session end would also shut down this session's worlds.
"""

from __future__ import annotations

import importlib.metadata as importlib_metadata
import json
import os
import sys
import textwrap

import pytest

from hp_core.plugins import ENV_PLUGINS, INNER_WRAPPER_REGISTRY
from hp_core.testing import PluginSandbox
from hp_core.testing.pytest_plugin import HpWorldSizeError, added_import_paths
from hp_core.testing.sandbox import (
    SandboxModuleClashError,
    SandboxNameError,
    SandboxNotInstalledError,
)

pytest_plugins = ["pytester"]

PLUGIN = "hp_core.testing.pytest_plugin"
_INSTALLED = any(ep.value == PLUGIN for ep in importlib_metadata.entry_points(group="pytest11"))
#: Loads the plugin in an inner session whether or not hp-core's entry point is installed.
WITH_HP = [] if _INSTALLED else ["-p", PLUGIN]
WITHOUT_HP = ["-p", "no:hp"]

RANK_TASKS = """
    import os

    import torch
    import torch.distributed as dist


    def rank_sum():
        t = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(t)
        return {"sum": float(t), "pid": os.getpid()}
"""

# Imports the rank tasks the plain way: in importlib mode only the plugin's path makes it work.
TEST_WITH_HP_WORLD = """
    import json
    from pathlib import Path

    import pytest
    from inner_rank_tasks import rank_sum


    @pytest.mark.distributed
    def test_two_ranks(hp_world):
        world = hp_world(2)
        assert hp_world(2) is world
        out = world.run(rank_sum)
        assert [o["sum"] for o in out] == [3.0, 3.0]
        Path(__file__).with_name("pids.json").write_text(json.dumps([o["pid"] for o in out]))
"""

# Loads the rank tasks from their file, so this process never needs the folder on sys.path;
# the spawned ranks do (they unpickle rank_sum by its module name).
TEST_BY_FILE = """
    import importlib.util
    import sys
    from pathlib import Path

    from hp_core.testing import get_world

    _path = Path(__file__).with_name("inner_rank_tasks.py")
    _spec = importlib.util.spec_from_file_location("inner_rank_tasks", _path)
    _tasks = importlib.util.module_from_spec(_spec)
    sys.modules["inner_rank_tasks"] = _tasks
    _spec.loader.exec_module(_tasks)


    def test_two_ranks():
        out = get_world(2).run(_tasks.rank_sum)
        assert [o["sum"] for o in out] == [3.0, 3.0]
"""


def _write_session(pytester: pytest.Pytester, test_source: str) -> str:
    """The rank tasks and a test module in a subfolder: ``python -m pytest`` puts the
    working directory on ``sys.path``, so they must not sit in it."""
    sub = pytester.mkdir("suite")
    (sub / "inner_rank_tasks.py").write_text(textwrap.dedent(RANK_TASKS))
    (sub / "test_inner.py").write_text(textwrap.dedent(test_source))
    return str(sub)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.distributed
def test_rank_tasks_next_to_the_tests_import_and_worlds_end_with_the_session(pytester):
    suite = _write_session(pytester, TEST_WITH_HP_WORLD)
    result = pytester.runpytest_subprocess(*WITH_HP, "--strict-markers", suite)
    result.assert_outcomes(passed=1)
    pids = json.loads((pytester.path / "suite" / "pids.json").read_text())
    assert len(pids) == 2 and os.getpid() not in pids
    assert not [pid for pid in pids if _pid_alive(pid)], "the session's ranks outlived it"


COVERAGE_RC = """
    [run]
    concurrency = multiprocessing,thread
    parallel = true
    sigterm = true
"""


@pytest.mark.distributed
def test_the_ranks_coverage_is_combined_into_the_sessions_report(pytester):
    """``rank_sum`` runs on the ranks only: its lines count as covered only if the worlds
    stop before pytest-cov combines (at the end of the test loop, not at session finish)."""
    suite = _write_session(pytester, TEST_WITH_HP_WORLD)
    rc = pytester.path / "coverage.rc"
    rc.write_text(textwrap.dedent(COVERAGE_RC))
    report = pytester.path / "cov.json"
    result = pytester.runpytest_subprocess(
        *WITH_HP, f"--cov={suite}", f"--cov-config={rc}", f"--cov-report=json:{report}", suite
    )
    result.assert_outcomes(passed=1)
    files = json.loads(report.read_text())["files"]
    (tasks,) = [v for k, v in files.items() if k.endswith("inner_rank_tasks.py")]
    body = textwrap.dedent(RANK_TASKS).splitlines()
    line = body.index("    dist.all_reduce(t)") + 1
    assert line in tasks["executed_lines"], f"rank-only line {line} not measured: {tasks}"


@pytest.mark.distributed
def test_importlib_mode_ranks_import_by_the_plugins_paths(pytester):
    suite = _write_session(pytester, TEST_BY_FILE)
    result = pytester.runpytest_subprocess(*WITH_HP, "--import-mode=importlib", suite)
    result.assert_outcomes(passed=1)


@pytest.mark.distributed
def test_importlib_mode_without_the_plugin_the_ranks_cannot_import(pytester):
    """Negative control: the same session without the plugin; the ranks die unpickling."""
    suite = _write_session(pytester, TEST_BY_FILE)
    result = pytester.runpytest_subprocess(*WITHOUT_HP, "--import-mode=importlib", suite)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*WorldError*rank(s)*died*"])
    out = result.stdout.str() + result.stderr.str()
    assert "No module named 'inner_rank_tasks'" in out


def test_the_folders_of_test_modules_and_conftests_go_on_sys_path(pytester):
    sub = pytester.mkdir("sub")
    (sub / "conftest.py").write_text("")
    (sub / "test_nothing.py").write_text("def test_ok():\n    pass\n")
    (sub / "helper.py").write_text("")  # not a test module: its folder is there anyway
    other = pytester.mkdir("other")
    (other / "helper_only.py").write_text("")  # no test module: not added
    result = pytester.runpytest(*WITH_HP, "--import-mode=importlib")
    result.assert_outcomes(passed=1)
    added = added_import_paths()
    assert str(pytester.path.resolve()) in added and str(sub.resolve()) in added
    assert str(other.resolve()) not in added


def test_the_distributed_marker_is_registered(pytester):
    pytester.makepyfile("import pytest\n\n@pytest.mark.distributed\ndef test_marked():\n    pass\n")
    # Subprocesses: in-process runs share pytest's cache of known markers with this session.
    pytester.runpytest_subprocess(*WITH_HP, "--strict-markers").assert_outcomes(passed=1)
    # Negative control: without the plugin, --strict-markers refuses the marker.
    result = pytester.runpytest_subprocess(*WITHOUT_HP, "--strict-markers")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*'distributed' not found in `markers`*"])


SANDBOX_TESTS = """
    import importlib.metadata as md
    import os
    import sys

    from hp_core.plugins import INNER_WRAPPER_REGISTRY, plugin_report

    SOURCE = '''
    from hp_core.hookspecs import hookimpl
    from hp_core.injection import inner_wrapper

    HP_PLUGIN_API = 2

    @inner_wrapper
    def sbx_attn(target_module, ctx):
        return None

    @hookimpl
    def hp_register_inner_wrappers(register):
        register("sbx_attn", sbx_attn)
    '''


    def test_a_installs(hp_plugins):
        assert "HP_PLUGINS" not in os.environ
        dist = hp_plugins.install(
            "sbx", {"sbx_plugin_mod": SOURCE}, items={"inner_wrapper.sbx_attn": "sbx_plugin_mod"}
        )
        assert dist == "hp-plugin-sbx"
        rows = {p.name: p for p in hp_plugins.report()}
        assert rows["sbx"].status == "loaded" and rows["sbx"].distribution == dist
        assert INNER_WRAPPER_REGISTRY["sbx_attn"].distribution == dist
        eps = md.distribution(dist).entry_points
        assert [(e.name, e.value) for e in eps.select(group="hp_core.items")] == [
            ("inner_wrapper.sbx_attn", "sbx_plugin_mod")
        ]


    def test_b_sees_nothing_of_it():
        assert "sbx" not in {p.name for p in plugin_report()}
        assert "sbx_attn" not in INNER_WRAPPER_REGISTRY
        assert "sbx_plugin_mod" not in sys.modules
        assert "hp-plugin-sbx" not in {d.metadata["Name"] for d in md.distributions()}
        assert os.environ.get("HP_PLUGINS") == "from-outside"
"""


def test_hp_plugins_installs_for_one_test_only(pytester, monkeypatch):
    monkeypatch.setenv(ENV_PLUGINS, "from-outside")
    pytester.makepyfile(test_sandbox=SANDBOX_TESTS)
    pytester.runpytest(*WITH_HP, "-p", "no:randomly").assert_outcomes(passed=2)
    assert os.environ[ENV_PLUGINS] == "from-outside"


PLUGIN_SOURCE = """
from hp_core.hookspecs import hookimpl
from hp_core.injection import inner_wrapper

HP_PLUGIN_API = 2

@inner_wrapper
def {name}_attn(target_module, ctx):
    return None

@hookimpl
def hp_register_inner_wrappers(register):
    register("{name}_attn", {name}_attn)
"""


def _names(sandbox: PluginSandbox) -> dict[str, str]:
    return {p.name: p.status for p in sandbox.report()}


def test_uninstall_disable_and_enable_only(hp_plugins):
    hp_plugins.install("sba", {"sba_mod": PLUGIN_SOURCE.format(name="sba")})
    hp_plugins.install("sbb", {"sbb_mod": PLUGIN_SOURCE.format(name="sbb")}, dist="sbb-dist")
    assert _names(hp_plugins)["sba"] == "loaded" and _names(hp_plugins)["sbb"] == "loaded"

    hp_plugins.disable("sba")
    rows = _names(hp_plugins)
    assert rows["sba"] == "disabled" and rows["sbb"] == "loaded" and rows["cp"] == "loaded"
    assert "sba_attn" not in INNER_WRAPPER_REGISTRY and "sbb_attn" in INNER_WRAPPER_REGISTRY

    hp_plugins.enable_only("sba")
    rows = _names(hp_plugins)
    assert rows["sba"] == "loaded" and rows["sbb"] == "disabled" and rows["cp"] == "disabled"

    hp_plugins.enable_only("sba", "sbb")
    hp_plugins.disable("sbb")  # narrows the HP_PLUGINS already set
    assert os.environ[ENV_PLUGINS] == "sba" and _names(hp_plugins)["sbb"] == "disabled"

    hp_plugins.enable_only()
    assert "loaded" not in _names(hp_plugins).values()

    os.environ.pop(ENV_PLUGINS)
    hp_plugins.uninstall("sbb-dist")
    rows = _names(hp_plugins)
    assert "sbb" not in rows and rows["sba"] == "loaded"
    assert "sbb_mod" not in sys.modules and "sbb_attn" not in INNER_WRAPPER_REGISTRY


def test_install_path_uses_an_existing_package_folder(hp_plugins, tmp_path):
    src = tmp_path / "src"
    (src / "sbpath_pkg").mkdir(parents=True)
    (src / "sbpath_pkg" / "__init__.py").write_text("")
    (src / "sbpath_pkg" / "plugin.py").write_text(PLUGIN_SOURCE.format(name="sbpath"))
    dist = hp_plugins.install_path(src, dist="hp-plugin-sbpath", entry_point="sbpath_pkg.plugin")
    assert _names(hp_plugins)["sbpath"] == "loaded" and str(src) in sys.path
    assert INNER_WRAPPER_REGISTRY["sbpath_attn"].distribution == dist
    hp_plugins.uninstall(dist)
    assert "sbpath" not in _names(hp_plugins) and str(src) not in sys.path
    assert not [m for m in sys.modules if m.startswith("sbpath_pkg")]
    with pytest.raises(SandboxNameError, match=r"not a folder.*Fix:"):
        hp_plugins.install_path(src / "missing", dist="x", entry_point="x.plugin")


def test_a_closed_sandbox_restores_the_environment_and_sys_path(monkeypatch):
    monkeypatch.setenv(ENV_PLUGINS, "outer")
    path_before = list(sys.path)
    with PluginSandbox() as sandbox:
        assert ENV_PLUGINS not in os.environ and str(sandbox.root) in sys.path
        sandbox.install("sbc", {"sbc_mod": PLUGIN_SOURCE.format(name="sbc")})
        sandbox.enable_only("sbc")
        assert _names(sandbox)["sbc"] == "loaded"
    assert os.environ[ENV_PLUGINS] == "outer" and sys.path == path_before
    assert not sandbox.root.exists()


def test_hp_world_refuses_a_bad_size(hp_world):
    for bad in (0, -1, "2", 2.0, True):
        with pytest.raises(HpWorldSizeError, match=r"hp_world\(.*\).*positive int.*Fix:"):
            hp_world(bad)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda s: s.install("x", {"x_mod": ""}, dist="bad name!"), SandboxNameError, "PEP 508"),
        (lambda s: s.install("x", {"json": ""}), SandboxModuleClashError, "'json'.*imported"),
        (lambda s: s.install("x", {"x-mod": ""}), SandboxNameError, "'x-mod'.*identifier"),
        (lambda s: s.install("x y", {"x_m": ""}, dist="xd"), SandboxNameError, "entry-point name"),
        (lambda s: s.install("x", {}), SandboxNameError, "no modules"),
        (lambda s: s.uninstall("never-installed"), SandboxNotInstalledError, "did not install"),
    ],
    ids=["dist-name", "module-clash", "module-name", "entry-name", "no-modules", "uninstall"],
)
def test_sandbox_refuses_bad_input(hp_plugins, call, error, match):
    before = {p.name for p in hp_plugins.report()}
    with pytest.raises(error, match=rf"{match}.*Fix:"):
        call(hp_plugins)
    assert {p.name for p in hp_plugins.report()} == before
    assert list(hp_plugins.root.glob("*.dist-info")) == []


def test_sandbox_refuses_a_second_install_of_a_dist_or_module(hp_plugins):
    hp_plugins.install("sbd", {"sbd_mod": PLUGIN_SOURCE.format(name="sbd")})
    with pytest.raises(SandboxNameError, match=r"already installed.*Fix:"):
        hp_plugins.install("sbd", {"sbd_other": ""})
    with pytest.raises(SandboxModuleClashError, match=r"'sbd_mod'.*another distribution.*Fix:"):
        hp_plugins.install("sbe", {"sbd_mod": ""})
    infos = [d.name for d in hp_plugins.root.glob("*.dist-info")]
    assert infos == ["hp_plugin_sbd-0.1.0.dist-info"]


def test_the_sandbox_module_needs_no_pytest():
    source = textwrap.dedent(
        """
        import sys
        sys.modules["pytest"] = None  # any import of pytest fails
        import hp_core.testing
        from hp_core.testing import PluginSandbox
        print("ok", PluginSandbox.__name__)
        """
    )
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0 and "ok PluginSandbox" in out.stdout, out.stderr
