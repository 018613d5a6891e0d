"""``hp freeze`` and ``hp check`` (with the verifier): artifacts from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hp_core.artifact
from hp_core import cli, plan
from hp_core.artifact import canonical_json, content_signature, freeze, read_artifact, same_plan
from hp_core.presets import build_model
from hp_core.testing.families import tiny_family_config
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)
from tests._qk_norm_helpers import no_qk_norm_scheme  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("builtin_only")

CP_YAML = """\
- match: model.layers.*.self_attn
  when: cp
  inner_wrapper: sdpa_hf
  inner_target: self
  region_dispatch: false
"""


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def frozen(capsys, tmp_path) -> Path:
    path = tmp_path / "llama.hp.json"
    assert run(capsys, "freeze", "--model", "llama", "--mesh", "tp=2", "-o", str(path))[0] == 0
    return path


def test_freeze_writes_a_signed_artifact(capsys, tmp_path):
    path = tmp_path / "a.json"
    code, out, err = run(capsys, "freeze", "--model", "llama", "--mesh", "tp=2", "-o", str(path))
    assert (code, err) == (0, "")
    artifact = read_artifact(path)
    assert (
        out == f"hp freeze: wrote {path}: 13 modules, 0 with injections, mesh tp=2, signature "
        f"{artifact.signature}\n"
    )
    assert same_plan(artifact.plan(), plan(build_model("llama", device="meta"), "tp=2"))
    again = tmp_path / "b.json"
    assert run(capsys, "freeze", "--model", "llama", "--mesh", "tp=2", "-o", str(again))[0] == 0
    assert again.read_bytes() == path.read_bytes()  # byte-stable


def test_freeze_flags_and_overrides(capsys, tmp_path):
    path = tmp_path / "moe.json"
    code, _, _ = run(
        capsys,
        "freeze",
        "--model",
        "qwen2moe",
        "--mesh",
        "tp=2,ep=2",
        "--ep",
        "2",
        "--no-sp",
        "--loss-parallel",
        "-o",
        str(path),
    )
    assert code == 0
    meta = read_artifact(path).meta
    assert (meta["sequence_parallel"], meta["loss_parallel"], meta["ep_size"]) == (False, True, 2)
    assert [r["ep_size"] for r in meta["injections"]] == [2, 2]
    overrides = tmp_path / "cp.yaml"
    overrides.write_text(CP_YAML)
    path = tmp_path / "cp.json"
    # sdpa_hf comes from hp-plugin-cp, which builtin_only leaves out: freeze it anyway
    code, out, _ = run(
        capsys,
        "freeze",
        "--model",
        "llama",
        "--mesh",
        "cp=2",
        "--overrides",
        str(overrides),
        "-o",
        str(path),
        "--allow-missing-plugins",
    )
    assert code == 0 and ": 11 modules, 2 with injections, mesh cp=2," in out
    artifact = read_artifact(path, check_registry=False)
    assert artifact.inputs["overrides"][0]["when"] == "cp"
    assert [r["inner_wrapper"] for r in artifact.meta["injections"]] == ["sdpa_hf", "sdpa_hf"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--mesh", "tp"],
            "hp freeze: error: --mesh: mesh 'tp': 'tp' is not AXIS=SIZE (e.g. 'tp=4,cp=2')\n",
        ),
        (["--model", "lama"], "hp freeze: error: --model: unknown model preset 'lama'."),
        (
            ["--overrides", "nope.yaml"],
            "hp freeze: error: --overrides: 'nope.yaml': no such file.\n",
        ),
        (
            ["-o", "no/such/dir/a.json"],
            "hp freeze: error: -o/--output: 'no/such/dir/a.json': its folder does not exist; "
            "name the artifact file to write.\n",
        ),
        (
            ["-o", "."],
            "hp freeze: error: -o/--output: '.': is a directory; name the artifact file to "
            "write.\n",
        ),
    ],
)
def test_freeze_usage_errors_exit_2(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    args = {"--model": "llama", "--mesh": "tp=2", "-o": "a.json"}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        args[flag] = value
    code, out, err = run(capsys, "freeze", *[x for kv in args.items() for x in kv])
    assert (code, out) == (2, "")
    assert err.startswith(message)
    assert not (tmp_path / "a.json").exists()


def test_freeze_problems_exit_1(capsys, tmp_path, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- match: model.nrom\n  params: none\n")
    code, _, err = run(
        capsys,
        "freeze",
        "--model",
        "llama",
        "--mesh",
        "tp=2",
        "--overrides",
        str(bad),
        "-o",
        str(tmp_path / "a.json"),
    )
    assert code == 1 and err.startswith(
        "hp freeze: error: OverrideError: overrides[0].match: 'model.nrom' is not a module "
        "of the model."
    )
    order = tmp_path / "order.yaml"
    order.write_text(
        "- match: model.norm\n  out_src: {b: {tp: shard(1)}, a: {tp: shard(1)}}\n  out_dst: "
        "{b: {tp: shard(1)}, a: {tp: shard(1)}}\n"
    )
    code, _, err = run(
        capsys,
        "freeze",
        "--model",
        "llama",
        "--mesh",
        "tp=2",
        "--overrides",
        str(order),
        "-o",
        str(tmp_path / "a.json"),
    )
    assert code == 1
    assert err == (
        "hp freeze: error: FreezeError: modules['model.norm']: its outputs ['b', 'a'] are "
        "ordered only by the key "
        "order of out_src, which an artifact does not keep (canonical JSON sorts keys). "
        "Declare the order: add "
        "out_names: ['b', 'a'] to the override for 'model.norm'.\n"
    )

    def full_disk(artifact, path):
        raise OSError("No space left on device")

    monkeypatch.setattr(hp_core.artifact, "write_artifact", full_disk)
    code, _, err = run(
        capsys, "freeze", "--model", "llama", "--mesh", "tp=2", "-o", str(tmp_path / "a.json")
    )
    assert (
        code == 1
        and err
        == f"hp freeze: error: cannot write {str(tmp_path / 'a.json')!r}: No space left on device\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "order.yaml"]


def test_check_without_a_model(capsys, frozen):
    code, out, err = run(capsys, "check", str(frozen))
    assert (code, err) == (0, "")
    signature = read_artifact(frozen).signature
    assert out == (
        f"hp check: {frozen}: signature ok ({signature}), format 1, 13 modules, mesh tp=2, "
        "injected registry items installed\n"
        "model: not checked (pass --model NAME_OR_CONFIG to check module names and coverage)\n"
        "verify: skipped (the artifact records only the model's digest, so hp cannot build "
        "the model; pass --model NAME_OR_CONFIG to verify the plan)\n"
    )


def test_check_with_the_right_model(capsys, frozen, tmp_path):
    code, out, err = run(capsys, "check", str(frozen), "--model", "llama")
    assert (code, err) == (0, "")
    assert (
        "\nmodel llama: frozen for this model, every planned module exists, lints pass "
        "(every trainable parameter covered)\nverified on mesh {'tp': 2} in "
    ) in out
    verified = out[out.index("\nverified on mesh {'tp': 2} in ") + 1 :]
    assert verified.endswith("\n")
    assert (
        "11 boundaries checked by propagation, 0 run on local tensors, 0 repeated layers skipped\n"
    ) in verified
    assert "  partial gradients summed over tp: 5 (model.layers.0.input_layernorm.weight," in (
        verified
    )
    build_model("llama", device="meta").config.to_json_file(tmp_path / "config.json")
    saved = tmp_path / "report.json"
    code, out, err = run(
        capsys, "check", str(frozen), "--model", str(tmp_path), "--report", str(saved)
    )
    assert (code, err) == (0, "")  # the same config from a file, with the report saved
    assert out.endswith(f"report written to {saved}\n")
    from hp_core.verifier import VerifyReport

    loaded = VerifyReport.loads(saved.read_text(), source=str(saved))
    assert dict(loaded.mesh) == {"tp": 2} and len(loaded.checked) == 11
    assert loaded.partial()["model.layers.0.input_layernorm.weight"] == ("tp",)


def test_check_report_needs_a_model_and_a_writable_path(capsys, frozen, tmp_path):
    code, out, err = run(capsys, "check", str(frozen), "--report", str(tmp_path / "r.json"))
    assert code == 2 and err.startswith("hp check: error: --report needs --model")
    assert not (tmp_path / "r.json").exists()
    code, out, err = run(
        capsys,
        "check",
        str(frozen),
        "--model",
        "llama",
        "--report",
        str(tmp_path / "no" / "r.json"),
    )
    assert code == 2 and err.startswith(
        f"hp check: error: cannot write the report to {str(tmp_path / 'no' / 'r.json')!r}"
    )
    assert "report written" not in out


def test_check_with_another_model(capsys, frozen):
    code, out, err = run(capsys, "check", str(frozen), "--model", "qwen2")
    assert code == 1 and "signature ok" in out
    assert err.startswith(
        "hp check: problem: model: the artifact was frozen for another model (digest sha256:"
    )
    assert out.endswith("verify: skipped (the model checks failed)\n")


def test_check_reports_lint_problems(capsys, tmp_path):
    model = build_model("llama", device="meta")
    live = plan(model, "tp=2")
    from hp_core.artifact import make_artifact, write_artifact
    from hp_core.plans import ShardingPlan

    holed = ShardingPlan(
        {f: s for f, s in live.items() if f != "model.norm"}, ("tp",), (2,), sequence_parallel=True
    )
    path = write_artifact(make_artifact(holed, model=model), tmp_path / "holed.json")
    code, _, err = run(capsys, "check", str(path), "--model", "llama")
    assert code == 1
    assert err.startswith(
        "hp check: problem: CoverageError: trainable parameter(s) model.norm.weight are not "
        "declared by any boundary"
    )


@pytest.mark.usefixtures("no_qk_norm_scheme")  # the planner as before it sharded such norms
def test_check_refuses_a_plan_the_verifier_refuses(capsys, tmp_path):
    config = tmp_path / "olmo2"
    tiny_family_config("olmo2").save_pretrained(config)  # q/k norms span all heads: tp=2 is wrong
    path = tmp_path / "olmo2.hp.json"
    assert run(capsys, "freeze", "--model", str(config), "--mesh", "tp=2", "-o", str(path))[0] == 0
    code, out, err = run(capsys, "check", str(path))
    assert (code, err) == (0, "") and "verify: skipped (" in out  # nothing to verify against
    code, out, err = run(capsys, "check", str(path), "--model", str(config))
    assert code == 1
    assert "signature ok" in out and "lints pass" in out and "verified on mesh" not in out
    assert err.startswith(
        "hp check: problem: UndeclaredCommunicationError: "
        "model.layers.0.self_attn (Olmo2Attention): "
    )
    # a frozen plan cannot be planned again, so hp prints no fix it has not checked
    assert "hp cannot plan the model again to check a fix" in err and "Traceback" not in err
    assert "- match:" not in err


def test_check_refuses_a_tampered_artifact(capsys, frozen):
    frozen.write_text(frozen.read_text().replace('"tp":"shard(0)"', '"tp":"shard(1)"', 1))
    code, out, err = run(capsys, "check", str(frozen))
    assert (code, out) == (1, "")
    assert err.startswith(f"hp check: error: ArtifactSignatureError: {frozen}: signature mismatch:")


def test_check_refuses_missing_plugin_items(capsys, tmp_path):
    overrides = tmp_path / "cp.yaml"
    overrides.write_text(CP_YAML)
    path = tmp_path / "cp.json"
    argv = [
        "freeze",
        "--model",
        "llama",
        "--mesh",
        "cp=2",
        "--overrides",
        str(overrides),
        "-o",
        str(path),
    ]
    assert (
        run(capsys, *argv, "--allow-missing-plugins")[0] == 0
    )  # hp freeze alone refuses it (exit 2)
    code, out, err = run(capsys, "check", str(path))
    assert (code, out) == (1, "")
    assert err.startswith(
        f"hp check: error: ArtifactRegistryError: {path}: the plan injects items that no "
        "installed plugin provides:\n"
    )
    assert "'sdpa_hf' is not a registered inner wrapper" in err


def test_check_warns_about_version_drift(capsys, frozen):
    doc = json.loads(frozen.read_bytes())
    doc["inputs"]["hp_version"] = "0.0.1"
    doc["signature"] = content_signature({k: v for k, v in doc.items() if k != "signature"})
    frozen.write_bytes(canonical_json(doc))
    code, _, err = run(capsys, "check", str(frozen))
    assert code == 0
    assert err.startswith(
        "warning: hp 0.0.1 froze it; hp 0.1.0 is installed (the artifact still verifies;"
    )


def test_check_usage_and_read_errors(capsys, frozen, monkeypatch):
    assert run(capsys, "check", "nope.json") == (
        2,
        "",
        "hp check: error: 'nope.json': no such file.\n",
    )
    code, out, err = run(capsys, "check", str(frozen), "--model", "lama")
    assert (code, out) == (2, "") and err.startswith(
        "hp check: error: --model: unknown model preset 'lama'."
    )
    code, _, err = run(capsys, "check")
    assert code == 2 and "the following arguments are required: ARTIFACT" in err

    def unreadable(path, **kwargs):
        raise PermissionError("Permission denied")

    monkeypatch.setattr(hp_core.artifact, "read_artifact", unreadable)
    assert run(capsys, "check", str(frozen)) == (
        1,
        "",
        f"hp check: error: cannot read {str(frozen)!r}: Permission denied\n",
    )


def test_console_script_freeze_then_check(tmp_path, capsys):
    exe = Path(sys.executable).with_name("hp")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HP_DISABLE_PLUGIN_AUTOLOAD": "1"}
    path = tmp_path / "a.json"
    done = subprocess.run(
        [str(exe), "freeze", "--model", "mistral", "--mesh", "tp=2", "--no-sp", "-o", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        f"hp freeze: wrote {path}: 11 modules, 0 with injections, mesh tp=2, signature sha256:"
    )
    assert read_artifact(path).meta == freeze(
        plan(build_model("mistral", device="meta"), "tp=2", sequence_parallel=False)
    )
    assert cli.main(["check", str(path), "--model", "mistral"]) == 0
