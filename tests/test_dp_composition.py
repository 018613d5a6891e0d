"""hp on tp inside, FSDP2 or DDP on dp outside: every gradient equals a single device's.

World 4 (dp=2 x tp=2). Each dp replica trains on its own batch; the single-device
reference trains on both (the mean of their losses), so data parallelism's averaging is
part of what is checked. hp's derived reductions (sequence-parallel norms) must still run
after FSDP2 replaced the parameters, and survive DDP writing the gradients back.
"""

from __future__ import annotations

import pytest

from hp_core.testing import get_world
from tests import dist_tasks_dp as tasks

pytestmark = pytest.mark.distributed
TOL = 1e-5


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
@pytest.mark.parametrize(
    "wrapper,mode", [("fsdp", "production"), ("ddp", "production"), ("fsdp", "validate")]
)
def test_data_parallel_wrapper_over_tensor_parallel_matches_one_device(wrapper, mode, sp):
    for r in get_world(4).run(tasks.train, wrapper, sp, mode):
        assert r["loss"] <= TOL and r["grad"] <= TOL, r
        assert r["unmoved"] == [] and r["min_checked"] > 0 and r["n_grads"] > 0
        # SP: the norms' partial gradients are summed once per step, after the wrapper's own
        # reduction
        assert r["reductions"] == ([1, 2, 3] if sp else [0, 0, 0])  # cumulative count


@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_without_hps_reductions_the_norm_gradients_are_wrong(wrapper):
    """Negative control: the same comparison catches partial sequence-parallel norm gradients."""
    for r in get_world(4).run(tasks.train, wrapper, True, hp_reduces=False, steps=1):
        assert r["grad"] > 1e-3, r
        assert "input_layernorm.weight" in r["problems"]  # the replicas' partial sums differ


def test_ddp_cannot_hold_validate_modes_dtensor_parameters():
    """The documented limit: DDP flattens parameters into plain buckets; torch refuses DTensors."""
    for r in get_world(4).run(tasks.ddp_over_validate):
        assert r["type"] == "RuntimeError" and "mixed torch.Tensor and DTensor" in r["message"]


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "qwen2_moe"])
def test_fsdp2_over_tp_matches_one_device_on_more_families(family):
    """Per-head q/k norms, a scaled embedding with sandwich norms, an MoE block on local
    tensors: their derived reductions still run after FSDP2 replaced the parameters."""
    for r in get_world(4).run(tasks.train, "fsdp", True, "production", family):
        assert r["loss"] <= TOL and r["grad"] <= TOL, r
        assert r["unmoved"] == [] and r["min_checked"] > 0
