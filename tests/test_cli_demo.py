"""`hp demo`: the default run on real ranks, the degraded run without plugins, the verdict and the
errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hp_core import cli, demo
from hp_core.plugins import reset_plugins

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("plugin_env")


def hp_demo(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HP_PLUGIN")}
    environ.update(env)
    if "coverage" in sys.modules:  # measure the subprocess and its ranks too
        environ.setdefault("COVERAGE_PROCESS_START", str(ROOT / "pyproject.toml"))
    return subprocess.run(
        [sys.executable, "-m", "hp_core.cli", "demo", *argv],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=environ,
    )


def test_default_demo_trains_cp_tp_ep_and_matches():
    run = hp_demo("--steps", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "qwen2moe on 4 CPU ranks, mesh cp=2,tp=2, ep=2, 2 steps" in out
    assert "2 x model.layers.*.self_attn  [inner_wrapper=sdpa_hf]" in out
    assert "2 x model.layers.*.mlp  [local_compute_fn=qwen2moe]" in out
    assert "forward: 4 all_gather on tp" in out
    assert "training adapters: cp" in out
    # Everything rank 0 issues in one step: the plan's tp collectives (as predicted above),
    # one packed K/V all-gather per attention layer, 3 all-to-alls per MoE layer, the CP loss sum,
    # and the input check on cp and on tp.
    assert "  forward: 6 all_gather, 4 all_reduce, 6 all_to_all, 2 reduce_scatter" in out
    assert "params per rank: " in out
    assert "│    1 │" in out and "ok" in out
    assert "every step matches the single-device run" in out
    assert "Traceback" not in run.stderr and "note:" not in out


def test_without_plugins_the_mesh_degrades_with_a_note():
    run = hp_demo("--steps", "1", HP_DISABLE_PLUGIN_AUTOLOAD="1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "note: hp-plugin-cp is not loaded: no cp axis" in run.stdout
    assert "note: hp-plugin-moe is not loaded: no expert parallelism" in run.stdout
    assert "note: default mesh degraded to tp=2 on 2 ranks" in run.stdout
    assert "qwen2moe on 2 CPU ranks, mesh tp=2, ep=1" in run.stdout
    assert "training adapters: none" in run.stdout
    assert "every step matches" in run.stdout and "Traceback" not in run.stderr


def test_default_setup_follows_the_loaded_plugins(monkeypatch):
    full = demo.default_setup()
    assert (full.mesh, full.ep, full.world) == ((("cp", 2), ("tp", 2)), 2, 4)
    assert (
        "inner_wrapper: sdpa_hf" in full.overrides
        and "local_compute_fn: qwen2moe" in full.overrides
    )
    assert demo.default_setup("mixtral", world=2).mesh == (("tp", 2),)
    assert "local_compute_fn: mixtral" in demo.default_setup("mixtral").overrides
    dense = demo.default_setup("llama", mesh="tp=2,cp=2")
    assert (dense.mesh, dense.ep, dense.mesh_text) == ((("cp", 2), ("tp", 2)), 1, "cp=2,tp=2")
    assert "local_compute_fn" not in dense.overrides
    monkeypatch.setenv("HP_PLUGINS", "")
    reset_plugins()
    bare = demo.default_setup(world=2)
    assert bare.mesh == (("tp", 2),) and bare.ep == 1 and bare.overrides == ""
    assert len(bare.notes) == 2  # no cp, no ep; the world was given, so no degradation note
    with pytest.raises(demo.DemoError, match="no CP attention wrapper 'sdpa_hf' is registered"):
        demo.default_setup(mesh="cp=2,tp=2")
    with pytest.raises(demo.DemoError, match="has no compute factory"):
        demo.default_setup(world=2, ep=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mesh": "tp=2,dp=2"}, "'dp=2' is not tp=N or cp=N"),
        ({"mesh": "tp=2,tp=2"}, "'tp=2' is not tp=N or cp=N"),
        ({"mesh": "tp=0"}, "'tp=0' is not"),
        ({"mesh": "tp=2", "world": 4}, "--world 4 does not match --mesh tp=2"),
        ({"model": "llama", "ep": 2}, "llama is not an MoE model"),
    ],
)
def test_setup_errors(kwargs, message):
    with pytest.raises(demo.DemoError, match=message):
        demo.default_setup(**kwargs)


def test_verdict():
    good = [demo.StepRow(0, 4.0, 4.00001), demo.StepRow(1, 1.0, 1.0)]
    assert demo.verdict(good) == 0
    assert demo.verdict([*good, demo.StepRow(2, 4.0, 4.001)]) == 1
    assert demo.verdict([]) == 1  # no steps compared is not a pass
    assert demo.verdict([demo.StepRow(0, 4.0, 4.001)], atol=1e-2) == 0
    assert demo.StepRow(0, 1.0, 1.5).diff == 0.5


def test_cli_reports_a_mismatch_with_exit_1(monkeypatch, capsys):
    reports = [
        {
            "rank": 0,
            "params": 10,
            "losses": [(4.0, 4.0), (4.0, 4.5)],
            "adapters": (),
            "measured": {},
        }
    ]
    monkeypatch.setattr(demo, "run_demo", lambda setup: reports)
    assert cli.main(["demo", "--model", "llama", "--mesh", "tp=2", "--steps", "2"]) == 1
    out, err = capsys.readouterr()
    assert "MISMATCH" in out and "MISMATCH at step(s) [1]" in err
    assert "training adapters: none" in out


def test_cli_errors(monkeypatch, capsys):
    assert cli.main(["demo", "--mesh", "tp=2", "--world", "4"]) == 2
    assert "hp demo: error: --world 4 does not match" in capsys.readouterr().err
    assert (
        cli.main(["demo", "--model", "llama", "--mesh", "tp=8"]) == 1
    )  # 4 heads cannot split over 8
    assert "cannot plan llama for tp=8" in capsys.readouterr().err

    def fail(setup):
        raise demo.DemoError("rank 1 failed:\nboom")

    monkeypatch.setattr(demo, "run_demo", fail)
    assert cli.main(["demo", "--model", "llama", "--mesh", "tp=2"]) == 1
    assert "hp demo: error: rank 1 failed" in capsys.readouterr().err


def test_a_failing_rank_is_reported_not_hung():
    setup = demo.DemoSetup(
        "llama", (("tp", 1),), overrides="- match: 'model.norm'\n  bogus: 1\n", steps=1
    )
    with pytest.raises(demo.DemoError, match="rank 0 failed:"):
        demo.run_demo(setup)
