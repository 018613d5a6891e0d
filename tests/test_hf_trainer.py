"""HpTrainer refuses what it cannot train correctly, before any training (its end-to-end run
against one device is in tests/test_examples.py)."""

from __future__ import annotations

import pytest
from transformers import TrainingArguments

from hp_core import HpError
from hp_core.hf_trainer import HpTrainer, HpTrainerError
from hp_core.testing.families import build_family


class _Mesh:
    def __init__(self, names: tuple[str, ...], shape: tuple[int, ...]) -> None:
        self.mesh_dim_names, self.shape = names, shape


@pytest.fixture
def training(tmp_path):
    return TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no"
    )


def test_a_mesh_without_a_dp_axis_is_refused_with_the_fix(training):
    with pytest.raises(HpTrainerError) as e:
        HpTrainer(model=build_family("llama"), args=training, mesh=_Mesh(("tp",), (2,)))
    assert isinstance(e.value, HpError) and isinstance(e.value, ValueError)
    assert "axes ['tp'] but no 'dp' axis" in str(e.value) and "mesh_dim_names=('dp', 'tp')" in str(
        e.value
    )


def test_a_model_hp_did_not_parallelize_is_refused(training):
    with pytest.raises(
        HpTrainerError, match=r"LlamaForCausalLM was not parallelized by hp; call hp_core.apply"
    ):
        HpTrainer(model=build_family("llama"), args=training, mesh=_Mesh(("dp", "tp"), (1, 1)))


def test_ranks_sharing_a_batch_come_from_the_mesh(training):
    model = build_family("llama")
    model._hp_applied = object()  # what apply leaves; the sizes are all this test reads
    trainer = HpTrainer(model=model, args=training, mesh=_Mesh(("dp", "cp", "tp"), (2, 3, 4)))
    assert (trainer.get_tp_size(), trainer.get_cp_size()) == (4, 3)
    assert (
        HpTrainer(model=model, args=training, mesh=_Mesh(("dp", "tp"), (2, 4))).get_cp_size() == 1
    )


@pytest.mark.distributed
def test_trainer_on_dp2_tp2_matches_one_device_and_a_plain_trainer_is_refused():
    """The example's check inside a 4-rank gloo world (tests/test_examples.py runs it under
    torchrun)."""
    from hp_core.testing.world import get_world
    from tests import dist_tasks_trainer as tasks

    world = get_world(4)
    for r in world.run(tasks.trainer_run, False, timeout=240):
        assert r["ok"] and r["type"] is None, r
    for rank, r in enumerate(world.run(tasks.trainer_run, True, timeout=240)):
        assert r["type"] == "WrappedOverModelParallelRanksError", (rank, r)
        assert "over ranks [0, 1, 2, 3]" in r["message"] and "HpTrainer" in r["message"]
