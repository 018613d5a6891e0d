"""The example scripts run end to end (they are what `make demo` shows)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.distributed


def test_tp_train_example_matches_single_device():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tp_train.py"), "--steps", "2", "--explain"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every step matches the single-device run" in out.stdout
    assert "model.layers.0.self_attn" in out.stdout  # the plan was explained


def _torchrun(*argv: str, nproc: int = 4) -> subprocess.CompletedProcess[str]:
    """An example launched the way users launch it: torchrun, ``nproc`` ranks on this host."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


@pytest.mark.parametrize("extra", [[], ["--ddp", "--no-sp"]], ids=["fsdp2-sp", "ddp-no-sp"])
def test_fsdp_tp_example_under_torchrun_matches_single_device(extra):
    """The recipe of docs/training.md, launched the way users launch it."""
    out = _torchrun(str(ROOT / "examples" / "fsdp_tp_train.py"), "--check", *extra)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every step matches the single-device run" in out.stdout


def test_hf_trainer_example_matches_single_device():
    """HpTrainer (Hugging Face Trainer) on dp=2 x tp=2: every step's gradient norm and the trained
    model's loss and logits match one device training on the union of the dp batches."""
    out = _torchrun(str(ROOT / "examples" / "hf_trainer_train.py"), "--check")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every step matches the single-device run" in out.stdout


def test_checkpoint_example_resumes_and_reshards_under_torchrun(tmp_path):
    """docs/checkpoints.md's recipe: dcp.save at tp=2, resume at tp=2, load in one process."""
    script = str(ROOT / "examples" / "checkpoint_dcp.py")
    out = _torchrun(script, "--dir", str(tmp_path / "ckpt"), nproc=2)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the checkpoint restores the model" in out.stdout
    assert (tmp_path / "ckpt" / ".metadata").exists()  # a real DCP checkpoint was written


def test_export_hf_example_round_trips_through_from_pretrained(tmp_path):
    """docs/checkpoints.md's export recipe: full_state_dict at tp=2, save_pretrained on rank 0,
    from_pretrained in one process gives the same logits."""
    script = str(ROOT / "examples" / "export_hf.py")
    out = _torchrun(script, "--dir", str(tmp_path / "hf"), nproc=2)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the exported model matches" in out.stdout
    assert (tmp_path / "hf" / "model.safetensors").exists()
    assert (tmp_path / "hf" / "config.json").exists()


def test_load_pretrained_example_matches_single_device(tmp_path):
    """docs/checkpoints.md's pretrained recipe: save_pretrained, meta-build, apply at tp=2,
    load_pretrained; the logits equal the single-device model's."""
    script = str(ROOT / "examples" / "load_pretrained.py")
    out = _torchrun(script, "--dir", str(tmp_path / "ck"), nproc=2)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the sharded load matches the single-device model" in out.stdout
    assert "q_proj shard (32, 64) of (64, 64)" in out.stdout
    assert (tmp_path / "ck" / "model.safetensors").is_file()
