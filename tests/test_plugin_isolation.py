"""Plugin isolation (BaseExceptions, the import time limit) and plan-time plugin checks.

A plugin may ``sys.exit()``, raise any BaseException or block at import: it is reported
as failed with its distribution and version, the other plugins load, and no unrelated
command changes its exit code. Only KeyboardInterrupt propagates. ``hp plan`` and ``hp
freeze`` refuse (exit 2) a plan naming registry items no installed plugin provides, with
the message ``hp_core.apply`` gives, unless ``--allow-missing-plugins``.
"""

from __future__ import annotations

import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest

from hp_core import cli
from hp_core.plugins import (
    ENV_IMPORT_TIMEOUT,
    INNER_WRAPPER_REGISTRY,
    HpPluginWarning,
    PluginInfo,
    PluginLoadError,
    _config,
    _discovery,
    _manager,
    _state,
    load_plugins,
    plugin_report,
    plugin_warnings,
    reset_plugins,
)
from tests._plugin_fakes import FakePlugins

GOOD = """
@hookimpl
def hp_register_inner_wrappers(register):
    register("{name}", good_wrapper, needs_cp=True, region_dispatch=False, forward_style="qkv")
"""

CUSTOM = """
class PluginAbort(BaseException):
    pass
"""


pytestmark = pytest.mark.usefixtures("plugin_env")


@pytest.fixture
def good(fakes):
    """A healthy plugin next to the broken one: it must still load."""
    fakes.plugin("healthy", GOOD.format(name="healthy_attn"), dist="fake-healthy", version="1.0")
    return fakes


def report() -> dict[str, PluginInfo]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HpPluginWarning)
        return {p.name: p for p in plugin_report()}


def failed(name: str, dist: str, version: str) -> PluginInfo:
    """The failed row of ``name``; the healthy plugin and the real ones loaded anyway."""
    rows = report()
    info = rows[name]
    assert (info.status, info.distribution, info.version, info.items) == (
        "failed",
        dist,
        version,
        0,
    ), info
    assert rows["healthy"].status == "loaded" and "healthy_attn" in INNER_WRAPPER_REGISTRY
    assert rows["cp"].status == "loaded" and rows["moe"].status == "loaded"
    return info


def table_row(out: str, first: str) -> list[str]:
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in:\n{out}")


def assert_commands_unaffected(capsys, name: str, dist: str, version: str, fragment: str) -> None:
    """``hp plugins`` exits 0 and shows the failure; an unrelated ``hp plan`` exits 0."""
    reset_plugins()
    code = cli.main(["plugins"])
    out, err = capsys.readouterr()
    assert code == 0, err
    cells = table_row(out, name)
    assert cells[1:4] == [dist, version, "failed"]
    assert fragment in out
    assert table_row(out, "healthy")[3] == "loaded"
    reset_plugins()
    assert cli.main(["plugins", "--strict"]) == 1  # the documented CI switch still fails
    assert (
        f"plugin {name!r} from distribution {dist} {version} failed to load"
        in capsys.readouterr().err
    )
    reset_plugins()
    code = cli.main(["plan", "--model", "llama", "--mesh", "tp=2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith("hp plan: mesh tp=2")


# ------------------------------------------------------------------ BaseExceptions


def test_sys_exit_at_import_fails_only_that_plugin(good, capsys):
    good.plugin("exiter", "import sys\nsys.exit(3)\n", dist="fake-exiter", version="2.1")
    info = failed("exiter", "fake-exiter", "2.1")
    assert info.error.startswith("importing entry point 'exiter = fake_exiter_")
    assert info.error.endswith("raised SystemExit: 3")
    with pytest.raises(PluginLoadError, match=r"plugin 'exiter' \(fake-exiter 2.1\)"):
        load_plugins(strict=True)
    assert_commands_unaffected(capsys, "exiter", "fake-exiter", "2.1", "raised SystemExit: 3")


def test_sys_exit_in_a_hook_fails_only_that_plugin(good, capsys):
    good.plugin(
        "hookexit",
        """
        import sys

        @hookimpl
        def hp_register_inner_wrappers(register):
            register("half_registered", good_wrapper, region_dispatch=False)
            sys.exit("plugin gave up")
        """,
        dist="fake-hookexit",
        version="0.3",
    )
    info = failed("hookexit", "fake-hookexit", "0.3")
    assert info.error == "hook hp_register_inner_wrappers raised SystemExit: plugin gave up"
    assert "half_registered" not in INNER_WRAPPER_REGISTRY  # all or nothing
    assert_commands_unaffected(
        capsys, "hookexit", "fake-hookexit", "0.3", "SystemExit: plugin gave up"
    )


def test_bare_sys_exit_in_a_hook_names_the_type(good):
    good.plugin(
        "bare",
        """
        import sys

        @hookimpl
        def hp_register_router_adapters(register):
            sys.exit()
        """,
    )
    assert (
        failed("bare", "fake-bare", "0.1").error
        == "hook hp_register_router_adapters raised SystemExit"
    )


def test_custom_base_exception_at_import_and_in_a_hook(good, capsys):
    good.plugin("aborter", CUSTOM + "raise PluginAbort('no GPU here')\n", dist="fake-aborter")
    good.plugin(
        "hookabort",
        CUSTOM
        + textwrap.dedent(
            """
            @hookimpl
            def hp_register_templates(register):
                raise PluginAbort("templates unavailable")
            """
        ),
        dist="fake-hookabort",
    )
    assert failed("aborter", "fake-aborter", "0.1").error.endswith(
        "raised PluginAbort: no GPU here"
    )
    error = failed("hookabort", "fake-hookabort", "0.1").error
    assert error == "hook hp_register_templates raised PluginAbort: templates unavailable"
    assert_commands_unaffected(capsys, "aborter", "fake-aborter", "0.1", "PluginAbort: no GPU here")


def test_generator_exit_in_a_hook(good):
    good.plugin(
        "genexit",
        """
        @hookimpl
        def hp_register_router_adapters(register):
            raise GeneratorExit("closed")
        """,
    )
    assert (
        failed("genexit", "fake-genexit", "0.1").error
        == "hook hp_register_router_adapters raised GeneratorExit: closed"
    )


@pytest.mark.parametrize("where", ["import", "hook"])
def test_keyboard_interrupt_propagates(good, capsys, where):
    body = (
        "raise KeyboardInterrupt('stop at import')\n"
        if where == "import"
        else """
        @hookimpl
        def hp_register_router_adapters(register):
            raise KeyboardInterrupt("stop in hook")
        """
    )
    good.plugin("ctrlc", body)
    with pytest.raises(KeyboardInterrupt, match=f"stop (at|in) {where}"):
        plugin_report()
    assert _manager._STATE is None and not _state.LOADING.active  # nothing half-loaded is kept
    with pytest.raises(KeyboardInterrupt):
        cli.main(["plugins"])
    capsys.readouterr()
    good.hide()  # without it, discovery works again
    assert "ctrlc" not in report()


# ------------------------------------------------------------------ the import time limit


def gate(fakes: FakePlugins) -> tuple[str, threading.Event]:
    """A module holding an Event that a blocking plugin waits on (importable by the plugin)."""
    name = f"fake_gate_{len(fakes.modules)}"
    fakes.add_distribution(
        f"fake-gate-{len(fakes.modules)}",
        {},
        modules={name: "import threading\nEVENT = threading.Event()\n"},
    )
    module = __import__(name)
    return name, module.EVENT


def import_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"hp-plugin-import:{name}"]


def test_a_plugin_blocking_at_import_times_out(good, monkeypatch, capsys):
    gate_module, event = gate(good)
    report()  # warm up: the real plugins are imported, so only the blocking one is timed
    good.plugin(
        "slow",
        f"import {gate_module}\n{gate_module}.EVENT.wait(60)\n",
        dist="fake-slow",
        version="4.2",
    )
    monkeypatch.setenv(ENV_IMPORT_TIMEOUT, "0.5")
    try:
        start = time.monotonic()
        rows = report()
        elapsed = time.monotonic() - start
        assert 0.5 <= elapsed < 2.0, elapsed
        info = failed("slow", "fake-slow", "4.2")
        assert info is not None and rows["slow"].status == "failed"
        assert "timed out: it did not finish within 0.5 s" in info.error
        assert "set HP_PLUGIN_IMPORT_TIMEOUT to a higher number of seconds" in info.error
        (thread,) = import_threads("slow")
        assert thread.daemon and thread.is_alive()  # abandoned, not stopped

        # The abandoned import holds its module's lock: a rediscovery times out on it again,
        # and returns.
        reset_plugins()
        start = time.monotonic()
        assert "did not finish within 0.5 s" in report()["slow"].error
        assert time.monotonic() - start < 2.0

        reset_plugins()
        code = cli.main(["plugins"])
        out, _ = capsys.readouterr()
        assert code == 0
        assert table_row(out, "slow")[1:4] == ["fake-slow", "4.2", "failed"]
        assert "did not finish within 0.5 s" in out
        reset_plugins()
        assert cli.main(["plan", "--model", "llama", "--mesh", "tp=2"]) == 0
        capsys.readouterr()
    finally:
        event.set()
    for thread in import_threads("slow"):
        thread.join(10)
        assert not thread.is_alive()
    # Once the import has finished, the next discovery loads the plugin normally.
    reset_plugins()
    assert report()["slow"].status == "loaded"


def test_imports_run_in_a_daemon_thread_unless_the_limit_is_off(fakes, monkeypatch):
    body = "import threading\nTHREAD = threading.current_thread()\n"
    module = fakes.plugin("where", body)
    assert report()["where"].status == "loaded"
    thread = __import__(module).THREAD
    assert thread.name == "hp-plugin-import:where" and thread.daemon

    fakes.cleanup()
    monkeypatch.setenv(ENV_IMPORT_TIMEOUT, "0")
    reset_plugins()
    assert report()["where"].status == "loaded"
    assert __import__(module).THREAD is threading.current_thread()


@pytest.mark.parametrize(
    ("raw", "expected", "warns"),
    [
        (None, 10.0, False),
        ("", 10.0, False),
        ("2.5", 2.5, False),
        ("0", None, False),
        ("off", None, False),
        ("inf", None, False),
        ("abc", 10.0, True),
        ("-1", 10.0, True),
        ("nan", 10.0, True),
    ],
)
def test_import_timeout_from_env(monkeypatch, raw, expected, warns):
    if raw is not None:
        monkeypatch.setenv(ENV_IMPORT_TIMEOUT, raw)
    timeout, problem = _config.import_timeout_from_env()
    assert timeout == expected
    assert (problem is not None) == warns
    if warns:
        assert problem.startswith(
            f"HP_PLUGIN_IMPORT_TIMEOUT={raw!r} is not a number of seconds; using 10 s."
        )
        reset_plugins()
        with pytest.warns(HpPluginWarning, match="HP_PLUGIN_IMPORT_TIMEOUT"):
            plugin_report()
        assert plugin_warnings() == [problem]


def test_registering_from_the_import_thread_fails_cleanly_not_by_timeout(fakes, monkeypatch):
    monkeypatch.setenv(ENV_IMPORT_TIMEOUT, "5")
    fakes.plugin(
        "eagerreg",
        """
        from hp_core.plugins import register_inner_wrapper
        register_inner_wrapper("too_early", good_wrapper)
        """,
    )
    start = time.monotonic()
    error = report()["eagerreg"].error
    assert time.monotonic() - start < 4.0
    assert (
        "plugin 'eagerreg' accessed the hp plugin registries while plugins are being loaded"
        in error
    )
    assert "too_early" not in INNER_WRAPPER_REGISTRY


def test_discovery_from_inside_an_import_imports_in_the_calling_thread(fakes, monkeypatch):
    """A package that triggers discovery while it is being imported, and whose own plugin
    module is in that package: an import thread would wait on the package's lock."""
    monkeypatch.setenv(ENV_IMPORT_TIMEOUT, "0.5")
    fakes.add_distribution(
        "fake-selfload",
        {"selfload": "fake_selfload_pkg.plugin"},
        modules={
            "fake_selfload_pkg.__init__": (
                "from hp_core.plugins import plugin_report\n"
                "ROWS = {p.name: p for p in plugin_report()}\n"
            ),
            "fake_selfload_pkg.plugin": (
                "from hp_core.hookspecs import hookimpl\n"
                "import fake_selfload_pkg\n\n"
                "HP_PLUGIN_API = 2\n\n"
                "@hookimpl\ndef hp_register_router_adapters(register):\n    "
                "register('selfload_router', len)\n"
            ),
        },
    )
    fakes.modules.append("fake_selfload_pkg")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HpPluginWarning)
        rows = __import__("fake_selfload_pkg").ROWS
    assert rows["selfload"].status == "loaded", rows["selfload"]
    assert _discovery.importing_in_this_thread() is False


# ------------------------------------------------------------------ plan-time plugin checks

CP_YAML = """\
- match: model.layers.*.self_attn
  when: cp
  inner_wrapper: sdpa_hf
  inner_target: self
  region_dispatch: false
"""

MOE_YAML = """\
- match: model.layers.*.mlp
  local_compute_fn: qwen2moe
  region_dispatch: false
"""

RING_YAML = """\
- match: model.layers.*.self_attn
  inner_wrapper: my_ring_attention
  inner_target: self
  region_dispatch: false
"""


def overrides(tmp_path: Path, text: str) -> str:
    path = tmp_path / "overrides.yaml"
    path.write_text(text)
    return str(path)


def hp(capsys, *argv: str) -> tuple[int, str, str]:
    reset_plugins()
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str, command: str) -> str:
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"hp {command}: error: ")
    return err.rstrip("\n")


def test_plan_refuses_a_wrapper_whose_plugin_is_not_installed(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HP_PLUGINS", "moe")  # hp-plugin-cp (sdpa_hf) is not loaded
    argv = [
        "plan",
        "--model",
        "llama",
        "--mesh",
        "cp=2",
        "--overrides",
        overrides(tmp_path, CP_YAML),
    ]
    code, out, err = hp(capsys, *argv)
    assert (code, out) == (2, "")
    line = one_error_line(err, "plan")
    assert line.startswith(
        "hp plan: error: plan['model.layers.0.self_attn'].inner_wrapper (and 1 more module): "
        "UnknownRegistryItemError: unknown inner wrapper 'sdpa_hf'. 'sdpa_hf' is declared by the "
        "installed distribution hp-plugin-cp 0.1.0 (entry point 'cp = hp_plugin_cp.plugin'), but "
        "its plugin 'cp' is disabled (not listed in HP_PLUGINS=moe)."
    )
    assert "Fix: load plugin 'cp' (add it to HP_PLUGINS" in line and "'cp' (disabled)" in line
    assert line.endswith("To plan anyway, pass --allow-missing-plugins.")

    # The message is apply's: --verify (preflight) refuses the plan with the same text.
    code, out, err = hp(capsys, *argv, "--allow-missing-plugins", "--verify")
    assert (code, out) == (1, "")
    warning, refusal = err.split("\nhp plan: error: ")
    assert warning.startswith(
        "warning: plan['model.layers.0.self_attn'].inner_wrapper (and 1 more module): "
    )
    where = "plan['model.layers.0.self_attn'].inner_wrapper: "
    assert refusal.startswith(
        f"UnknownRegistryItemError: {where}unknown inner wrapper 'sdpa_hf'.\n"
    )
    bare = " ".join(refusal.replace(where, "", 1).split())
    assert bare in " ".join(line.split())

    # Installed: plans without a word.
    monkeypatch.delenv("HP_PLUGINS")
    code, out, err = hp(capsys, *argv)
    assert (code, err) == (0, "")
    assert "inner_wrapper=sdpa_hf" in out


def test_allow_missing_plugins_warns_and_plans(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HP_DISABLE_PLUGIN_AUTOLOAD", "1")
    argv = [
        "plan",
        "--model",
        "llama",
        "--mesh",
        "cp=2",
        "--overrides",
        overrides(tmp_path, CP_YAML),
    ]
    code, out, err = hp(capsys, *argv, "--allow-missing-plugins")
    assert code == 0
    assert out.startswith("hp plan: mesh cp=2") and "inner_wrapper=sdpa_hf" in out
    assert err.count("\n") == 1
    assert err.startswith(
        "warning: plan['model.layers.0.self_attn'].inner_wrapper (and 1 more module): "
        "UnknownRegistryItemError: "
    )
    assert "declared by the installed distribution hp-plugin-cp" in err
    assert err.rstrip().endswith(
        "planning anyway (--allow-missing-plugins): hp_core.apply refuses this plan until a "
        "plugin provides it."
    )


def test_an_unknown_wrapper_gets_no_install_hint(capsys, tmp_path):
    argv = [
        "plan",
        "--model",
        "llama",
        "--mesh",
        "tp=2",
        "--overrides",
        overrides(tmp_path, RING_YAML),
    ]
    code, out, err = hp(capsys, *argv)
    assert (code, out) == (2, "")
    line = one_error_line(err, "plan")
    assert "UnknownRegistryItemError: unknown inner wrapper 'my_ring_attention'." in line
    assert "pip install" not in line and "Known inner wrappers: " in line
    assert "sdpa_qkv (plugin 'cp'" in line and "sharded_qk_norm (plugin 'builtin'" in line
    assert hp(capsys, *argv, "--allow-missing-plugins")[0] == 0


def test_plan_and_freeze_refuse_an_ep_plan_without_its_moe_plugin(capsys, tmp_path, monkeypatch):
    path = overrides(tmp_path, MOE_YAML)
    artifact = tmp_path / "moe.hp.json"
    plan_argv = ["plan", "--model", "qwen2moe", "--mesh", "tp=2", "--ep", "2", "--overrides", path]
    freeze_argv = ["freeze", *plan_argv[1:], "-o", str(artifact)]
    code, _, err = hp(capsys, *plan_argv)
    assert (code, err) == (0, "")  # hp-plugin-moe is installed

    monkeypatch.setenv("HP_PLUGINS", "cp,phi3")
    code, out, err = hp(capsys, *plan_argv)
    assert (code, out) == (2, "")
    line = one_error_line(err, "plan")
    assert line.startswith(
        "hp plan: error: plan['model.layers.0.mlp'].local_compute_fn (and 1 more module): "
        "UnknownRegistryItemError: unknown compute factory 'qwen2moe'."
    )
    assert "declared by the installed distribution hp-plugin-moe" in line
    assert "No compute factories are registered." in line

    code, out, err = hp(capsys, *freeze_argv)
    assert (code, out) == (2, "")
    line = one_error_line(err, "freeze")
    assert "unknown compute factory 'qwen2moe'" in line and line.endswith(
        "To freeze anyway, pass --allow-missing-plugins."
    )
    assert not artifact.exists()

    code, out, err = hp(capsys, *freeze_argv, "--allow-missing-plugins")
    assert code == 0 and out.startswith(f"hp freeze: wrote {artifact}: ")
    assert (
        err.startswith("warning: plan['model.layers.0.mlp'].local_compute_fn")
        and "freezing anyway" in err
    )
    assert artifact.exists()


def test_two_missing_items_are_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HP_DISABLE_PLUGIN_AUTOLOAD", "1")
    argv = [
        "plan",
        "--model",
        "qwen2moe",
        "--mesh",
        "cp=2",
        "--ep",
        "2",
        "--overrides",
        overrides(tmp_path, CP_YAML + MOE_YAML),
    ]
    code, _, err = hp(capsys, *argv)
    assert code == 2
    line = one_error_line(err, "plan")
    assert "unknown inner wrapper 'sdpa_hf'" in line
    assert (
        "Also missing: 'qwen2moe' (plan['model.layers.0.mlp'].local_compute_fn (and 1 more "
        "module))." in line
    )
    code, _, err = hp(capsys, *argv, "--allow-missing-plugins")
    assert code == 0 and err.count("\nwarning: ") == 1 and err.startswith("warning: ")


def test_user_registered_items_count_as_installed(capsys, tmp_path, monkeypatch):
    from hp_core.injection import inner_wrapper
    from hp_core.plugins import register_inner_wrapper

    @inner_wrapper
    def ring(target_module, ctx):
        return None

    monkeypatch.setenv("HP_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_plugins()
    register_inner_wrapper("my_ring_attention", ring, region_dispatch=False)
    code = cli.main(
        [
            "plan",
            "--model",
            "llama",
            "--mesh",
            "tp=2",
            "--overrides",
            overrides(tmp_path, RING_YAML),
        ]
    )
    _, err = capsys.readouterr()
    assert (code, err) == (0, "")


def test_help_lists_the_flag(capsys):
    for command in ("plan", "freeze"):
        assert cli.main([command, "--help"]) == 0
        assert "--allow-missing-plugins" in capsys.readouterr().out
