"""``hp plan``: presets, HF configs (offline), flags, overrides, --yaml, --verify, exit codes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import hp_core
from hp_core import cli, plan
from hp_core.plans import load_plan
from hp_core.plans.prediction import step_collectives
from hp_core.presets import (
    build_model,
    model_from_config,
    preset_config,
    tiny_config,
)
from hp_core.testing.families import tiny_family_config
from hp_core.testing.printed_fix import printed_fix
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)
from tests._qk_norm_helpers import disable_full_width_norms

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
    assert out.startswith(
        "hp plan: mesh tp=2 (2 devices); sequence parallel off; loss parallel on; ep_size 1\n"
    )
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
    assert (
        "override notes:\n  overrides[0]: skipped ('model.norm' when: cp; cp is not active)\n"
        in out
    )
    assert err.startswith(
        "warning: overrides[1]: glob 'model.layers.*.nothing' matched no derived boundary"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--model", "lama", "--mesh", "tp=2"],
            "hp plan: error: --model: unknown model preset 'lama'. Did you mean 'llama'?",
        ),
        (
            ["--model", "llama", "--mesh", "tp2"],
            "hp plan: error: --mesh: mesh 'tp2': 'tp2' is not AXIS=SIZE",
        ),
        (
            ["--model", "llama", "--mesh", "tp=2", "--overrides", "missing.yaml"],
            "hp plan: error: --overrides: 'missing.yaml': no such file.",
        ),
        (
            ["--model", "nowhere/config.json", "--mesh", "tp=2"],
            "hp plan: error: --model: 'nowhere/config.json': no such file.",
        ),
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
    assert err.startswith(
        "hp plan: error: DivisibilityError: model.layers.0.self_attn: 2 key/value heads"
    )
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
        [str(exe), "plan", "--model", "llama", "--mesh", "tp=2", "--verify"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("hp plan: mesh tp=2 (2 devices); sequence parallel on;")
    assert "collectives per training step" in done.stdout
    assert "reduction of the 5 gradient(s) the verifier found partial over tp)\n" in done.stdout
    assert "\n\nverified on mesh {'tp': 2} in " in done.stdout
    assert "  partial gradients summed over tp: 5 (" in done.stdout


# ------------------------------------------------------------------------ --verify

OLMO2_FIX = """\
- match: model.layers.*.self_attn
  params:
    q_proj.weight: {tp: replicate}
    k_proj.weight: {tp: replicate}
    v_proj.weight: {tp: replicate}
    o_proj.weight: {tp: replicate}
    q_norm.weight: {tp: replicate}
    k_norm.weight: {tp: replicate}
  in_dst:
    hidden_states: {tp: replicate}
  out_src:
    attn_output: {tp: replicate}
  tp_divide_attrs: []
"""


def collectives_section(out: str) -> str:
    """The "collectives per training step" block of ``hp plan`` output."""
    start = out.index("collectives per training step (")
    return out[start : out.index("\n\n", start)]


def summary_of(out: str, mesh: str) -> str:
    """The verifier's summary printed after the plan (``VerifyReport.summary()``)."""
    return out[out.index(f"\n\nverified on mesh {mesh} in ") + 2 :]


@pytest.fixture
def olmo2_config(tmp_path, monkeypatch) -> Path:
    """A tiny OLMo-2 config folder: q/k norms span all heads, so tp=2 attention is refused
    (by the planner as it was before it sharded such norms)."""
    disable_full_width_norms(monkeypatch)
    folder = tmp_path / "olmo2"
    tiny_family_config("olmo2").save_pretrained(folder)
    return folder


def test_verify_prints_the_report_and_the_verified_collectives(capsys, no_network):
    code, out, err = run(capsys, "--model", "llama", "--mesh", "tp=2", "--verify")
    assert (code, err) == (0, "")
    model = build_model("llama", device="meta")
    planned = plan(model, "tp=2")
    report = hp_core.verify(model, planned, "tp=2")
    # the plan with the verified reductions, then the verifier's summary
    assert out.startswith(planned.explain(report) + "\nverified on mesh {'tp': 2} in ")
    counts = step_collectives(planned.modules, reductions=report.reductions)
    assert counts[("backward", "all_reduce", "tp")] == 1  # the bucketed reduction
    section = collectives_section(out)
    assert (
        "  backward: 11\n    all_gather on tp: 5\n    all_reduce on tp: 1\n"
        "    reduce_scatter on tp: 5\n"
    ) in section
    assert section.endswith(
        "  (backward all_reduce on tp includes one bucketed reduction of the 5 gradient(s) "
        "the verifier found partial over tp)"
    )
    summary = summary_of(out, "{'tp': 2}")
    assert summary.endswith("\n") and summary.count("\n") == 2
    assert (
        "11 boundaries checked by propagation, 0 run on local tensors, 0 repeated layers skipped\n"
    ) in summary
    assert "  partial gradients summed over tp: 5 (model.layers.0.input_layernorm.weight," in (
        summary
    )


def test_verify_counts_the_reports_reductions_not_the_prediction(capsys, monkeypatch):
    real = hp_core.verify
    seen = []

    def no_partial_grads(model, plan, mesh=None, **kwargs):
        seen.append((type(model).__name__, next(model.parameters()).device.type, mesh))
        report = real(model, plan, mesh, **kwargs)
        report.reductions = ()
        return report

    monkeypatch.setattr(hp_core, "verify", no_partial_grads)
    code, out, _ = run(capsys, "--model", "llama", "--mesh", "tp=2", "--verify")
    assert code == 0
    assert seen == [("LlamaForCausalLM", "meta", "tp=2")]
    section = collectives_section(out)
    # no backward all_reduce: the prediction's reduction is not counted
    assert "  backward: 10\n    all_gather on tp: 5\n    reduce_scatter on tp: 5\n" in section
    assert "bucketed reduction" not in section


def test_verify_seven_b_on_eight_ranks(capsys):
    code, out, err = run(capsys, "--model", "llama-7b", "--mesh", "tp=8", "--verify")
    assert (code, err) == (0, "")
    model = model_from_config(preset_config("llama-7b"), device="meta")
    planned = plan(model, "tp=8")
    report = hp_core.verify(model, planned, "tp=8")
    assert out.startswith(planned.explain(report) + "\nverified on mesh {'tp': 8} in ")
    summary = summary_of(out, "{'tp': 8}")
    assert "30 repeated layers skipped\n  partial gradients summed over tp: 65 (" in summary
    section = collectives_section(out) + "\n"
    assert "    all_reduce on tp: 1\n    reduce_scatter on tp: 65\n" in section


def test_verify_with_yaml_stays_a_loadable_plan(capsys):
    code, out, _ = run(capsys, "--model", "llama", "--mesh", "tp=2", "--verify", "--yaml")
    assert code == 0
    assert "\n# verified on mesh {'tp': 2} in " in out
    assert "\n#   partial gradients summed over tp: 5 (" in out
    assert load_plan(out) == plan(build_model("llama", device="meta"), "tp=2")


def test_verify_refusal_exits_1_with_the_pasteable_fix(capsys, olmo2_config, no_network):
    code, out, err = run(capsys, "--model", str(olmo2_config), "--mesh", "tp=2", "--verify")
    assert (code, out) == (1, "")
    assert err.startswith(
        "hp plan: error: UndeclaredCommunicationError: model.layers.0.self_attn (Olmo2Attention): "
    )
    fix = printed_fix(err)  # planned and verified by hp before it printed it
    assert fix is not None and fix.overrides[0]["match"] == "model.layers.*.self_attn", err
    assert fix.overrides[0]["params"]["q_proj.weight"] == {"tp": "replicate"}
    assert "Traceback" not in err
    # without --verify the plan prints: the planner alone does not see the problem
    assert run(capsys, "--model", str(olmo2_config), "--mesh", "tp=2")[0] == 0


def test_verify_with_overrides_applying_the_fix(capsys, olmo2_config, tmp_path):
    fix = tmp_path / "fix.yaml"
    fix.write_text(OLMO2_FIX)
    argv = ["--model", str(olmo2_config), "--mesh", "tp=2", "--overrides", str(fix), "--verify"]
    code, out, err = run(capsys, *argv)
    assert (code, err) == (0, "")
    assert "model.layers.1.self_attn\n  params:\n    q_proj.weight: {tp: replicate}\n" in out
    assert (
        "  in hidden_states: shard(1)→replicate on tp: all_gather\n"
        "  out attn_output: replicate→shard(1)"
    ) in out
    assert "\n\nverified on mesh {'tp': 2} in " in out


def test_verify_refuses_a_preflight_problem(capsys):
    argv = ["--model", "qwen2moe", "--mesh", "tp=2", "--ep", "2", "--verify"]
    code, out, err = run(capsys, *argv)
    assert (code, out) == (1, "")
    assert err.startswith(
        "hp plan: error: PreflightError: model.layers.0.mlp: experts are sharded over ep=2"
    )
    assert "Traceback" not in err
