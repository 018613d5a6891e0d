"""``hp plan``: presets, HF config files (offline), flags, overrides, --yaml, exit codes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hp_core import cli
from hp_core.planner import plan
from hp_core.sharding_plan import load_plan
from hp_core.testing.models import build_model, tiny_config
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("builtin_only")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("hp plan must not touch the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_preset_prints_the_explanation(capsys, no_network):
    code, out, err = run(capsys, "--model", "llama", "--mesh", "tp=2")
    assert (code, err) == (0, "")
    expected = plan(build_model("llama", device="meta"), "tp=2").explain()
    assert out == expected
    assert "  in hidden_states: shard(1)→replicate on tp: all_gather (bwd reduce_scatter)" in out


def test_yaml_output_round_trips(capsys):
    code, out, _ = run(capsys, "--model", "qwen2", "--mesh", "dp=2,tp=2", "--yaml")
    assert code == 0
    assert load_plan(out) == plan(build_model("qwen2", device="meta"), "dp=2,tp=2")


def test_flags(capsys):
    code, out, _ = run(capsys, "--model", "llama", "--mesh", "tp=2", "--no-sp", "--loss-parallel")
    assert code == 0
    assert out.startswith("hp plan: mesh tp=2 (2 devices); sequence parallel off; loss parallel on; ep_size 1\n")
    assert "  out output: shard(2) on tp: unchanged\n" in out
    code, out, _ = run(capsys, "--model", "qwen2moe", "--mesh", "tp=2,cp=2", "--sp", "--ep", "2")
    assert code == 0
    assert "sequence parallel on; loss parallel off; ep_size 2" in out
    assert "  expert parallel: ep_size=2 over the derived (edp, ep) expert mesh\n" in out


def test_seven_b_preset(capsys):
    code, out, _ = run(capsys, "--model", "llama-7b", "--mesh", "tp=8,cp=2")
    assert code == 0
    assert "163 modules planned (163 boundaries)" in out
    assert "model.layers.31.mlp\n" in out


@pytest.mark.parametrize("as_dir", [True, False])
def test_hf_config_json_offline(capsys, tmp_path, no_network, monkeypatch, as_dir):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tiny_config("mixtral").to_json_file(tmp_path / "config.json")
    target = tmp_path if as_dir else tmp_path / "config.json"
    code, out, err = run(capsys, "--model", str(target), "--mesh", "tp=2", "--ep", "2")
    assert (code, err) == (0, "")
    assert out == plan(build_model("mixtral", device="meta"), "tp=2", ep_size=2).explain()


def test_overrides_file_notes_and_warnings(capsys, tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(
        "- match: model.norm\n  when: cp\n  region_dispatch: false\n"
        "- match: model.layers.*.nothing\n  region_dispatch: false\n"
        "- match: lm_head\n  out_dst: {tp: shard(2)}\n"
    )
    code, out, err = run(capsys, "--model", "llama", "--mesh", "tp=2", "--overrides", str(path))
    assert code == 0
    assert "  out output: shard(2) on tp: unchanged\n" in out
    assert "override notes:\n  overrides[0]: skipped ('model.norm' when: cp; cp is not active)\n" in out
    assert err.startswith("warning: overrides[1]: glob 'model.layers.*.nothing' matched no derived boundary")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "lama", "--mesh", "tp=2"], "hp plan: error: --model: unknown model preset 'lama'. Did you mean 'llama'?"),
        (["--model", "llama", "--mesh", "tp2"], "hp plan: error: --mesh: mesh 'tp2': 'tp2' is not AXIS=SIZE"),
        (["--model", "llama", "--mesh", "tp=2", "--overrides", "missing.yaml"], "hp plan: error: --overrides: 'missing.yaml': no such file."),
        (["--model", "nowhere/config.json", "--mesh", "tp=2"], "hp plan: error: --model: 'nowhere/config.json': no such file."),
    ],
)
def test_usage_errors_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.startswith(message), err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not a readable JSON config"),
        ('{"hidden_size": 64}', "has no 'model_type'"),
        ('{"model_type": "no_such_model"}', "transformers cannot build this config"),
        ('{"model_type": "t5"}', "cannot build a causal LM from"),
    ],
)
def test_bad_config_files_exit_2(capsys, tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    code, _, err = run(capsys, "--model", str(path), "--mesh", "tp=2")
    assert code == 2
    assert err.startswith("hp plan: error: --model: ") and message in err, err


def test_argparse_usage_errors_exit_2(capsys):
    assert cli.main(["plan", "--model", "llama", "--mesh", "tp=2", "--ep", "0"]) == 2
    assert "argument --ep: expected a positive integer, got 0" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "llama", "--mesh", "tp=2", "--ep", "x"]) == 2
    assert "expected a positive integer, got 'x'" in capsys.readouterr().err
    assert cli.main(["plan", "--mesh", "tp=2"]) == 2
    assert "the following arguments are required: --model" in capsys.readouterr().err


def test_planning_errors_exit_1(capsys, tmp_path):
    code, out, err = run(capsys, "--model", "llama", "--mesh", "tp=4")
    assert (code, out) == (1, "")
    assert err.startswith("hp plan: error: DivisibilityError: model.layers.0.self_attn: 2 key/value heads")
    path = tmp_path / "o.yaml"
    path.write_text("- match: lm_head\n  out_dst: {output: {tpp: replicate}}\n")
    code, _, err = run(capsys, "--model", "llama", "--mesh", "tp=2", "--overrides", str(path))
    assert code == 1
    assert "OverrideError: overrides[0].out_dst.output.tpp: mesh axis 'tpp'" in err
    assert "Did you mean 'tp'?" in err


def test_help_lists_plan(capsys):
    assert cli.main(["--help"]) == 0
    assert "plan" in capsys.readouterr().out
    assert cli.main(["plan", "--help"]) == 0
    assert "--no-sp" in capsys.readouterr().out


def test_console_script():
    exe = Path(sys.executable).with_name("hp")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [str(exe), "plan", "--model", "llama", "--mesh", "tp=2"], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("hp plan: mesh tp=2 (2 devices); sequence parallel on;")
    assert "collectives per training step" in done.stdout
