"""Full export for Hugging Face (issue 13, item 3): ``hp_core.full_state_dict``.

Real gloo worlds: at tp=2 (production and validate; llama, and qwen2 with biases and tied
embeddings), the export on rank 0 equals the single-device model's ``state_dict()``, the
other ranks get ``{}`` (or the same dict with ``rank0_only=False``), and
``save_pretrained`` + ``from_pretrained`` give the single-device logits. Expert-parallel
parameters (qwen2_moe's batched experts; a per-expert ``ModuleList`` toy that ``apply``
stacks) export under their original names; FSDP2 on dp over hp's tp layout exports too.
The stream keeps no yielded tensor alive; a corrupted shard shows up in the export.
"""

from __future__ import annotations

import pytest
import torch

import hp_core
from hp_core.checkpoint.names import original_names
from hp_core.testing import get_world
from hp_core.testing.families import build_family
from tests import dist_tasks_export as tasks
from tests.test_error_style import style_problems

pytestmark = pytest.mark.distributed

MODES = ["production", "validate"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("family", "tied"), [("llama", False), ("qwen2", True)])
def test_tp2_export_equals_one_device_and_loads_with_from_pretrained(family, tied, mode, tmp_path):
    r0, r1 = get_world(2).run(tasks.tp_export, family, mode, str(tmp_path / "hf"), tied)
    assert r0["rank0_only"] == [] and not r0["rank0_only_empty"]
    assert r1["rank0_only_empty"] and r1["rank0_only"] is None
    assert r0["everywhere"] == [] and r1["everywhere"] == []
    if tied:  # one tensor under both names, as model.state_dict() gives a tie
        assert r0["tied_one_tensor"] and r1["tied_one_tensor"]
    assert r0["loaded_params"] == []
    assert r0["sharded_vs_single"] <= 1e-5
    assert r0["loaded_vs_single"] <= 1e-5 and r0["loaded_vs_sharded"] <= 1e-5
    assert (tmp_path / "hf" / "model.safetensors").exists()


@pytest.mark.parametrize("mode", MODES)
def test_expert_parallel_parameters_export_under_their_original_names(mode, tmp_path):
    results = get_world(2).run(tasks.expert_export, mode, str(tmp_path / "hf"))
    assert results[0]["loaded_vs_single"] <= 1e-5  # through save_pretrained / from_pretrained
    for r in results:
        assert r["qwen2_moe_expert_meshes"] == [("edp", "ep")]
        assert r["qwen2_moe"] == []
        # the toy's per-expert ModuleList was stacked (each rank holds 2 of 4 experts) ...
        assert r["toy_local_shape"] == (2, 32, 64)
        stacked = r["toy_stacked"]["model.layers.0.block_sparse_moe.experts.w1.weight"]
        assert stacked == [
            f"model.layers.0.block_sparse_moe.experts.{i}.w1.weight" for i in range(4)
        ]
        assert len(r["toy_stacked"]) == 6  # w1, w2, w3 in two layers
        # ... and exports as the unapplied model's per-expert keys and values
        assert r["toy"] == []


@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_on_dp_over_hp_layouts_exports_the_full_model(mode):
    results = get_world(4).run(tasks.fsdp_export, mode)
    for rank, r in enumerate(results):
        assert r["fsdp_mesh"] == (["dp"] if mode == "production" else ["dp", "tp"])
        assert r["problems"] == []
        assert r["rank0_only"] == (21 if rank == 0 else 0)


def test_each_layout_gathers_to_rank_0_or_to_every_rank():
    """Even pieces on a 1-D mesh go to rank 0 with a gather (other ranks get None; the ranks
    of the other dp row take no part); other layouts all-gather, and rank 0 keeps the result."""
    results = get_world(4).run(tasks.gather_paths)
    for rank, r in enumerate(results):
        for key, ok in r.items():
            name, rank0_only = key.split("/")
            if rank0_only == "False" or rank == 0:
                assert ok is True, (rank, key)
            elif name.startswith(("rows", "columns")):  # gathered to rank 0: nothing here
                assert ok is None, (rank, key)
            else:  # all-gathered (uneven pieces, a 2-D mesh, no pieces): the caller drops it
                assert ok is True, (rank, key)


@pytest.mark.parametrize("mode", MODES)
def test_the_stream_keeps_no_yielded_tensor_alive(mode):
    for rank, r in enumerate(get_world(2).run(tasks.streaming, mode)):
        assert r["problems"] == [] and r["count"] == 21
        assert r["alive_after_drop"] == 0  # the stream holds no tensor it handed over
        # negative control: an iterator holding its last tensor is caught by the same check
        assert r["holding_alive_after_drop"] == 21
        assert r["rank0_only_names"] == (21 if rank == 0 else 0)
        assert r["rank0_only_alive_after_drop"] == 0
        assert r["rank0_only_problems"] == ([] if rank == 0 else None)


@pytest.mark.parametrize("mode", MODES)
def test_one_wrong_value_in_one_shard_shows_in_the_export(mode):
    for r in get_world(2).run(tasks.corrupted_shard, mode):
        assert r["before"] == []
        assert r["after"] == ["model.layers.1.mlp.down_proj.weight: values differ by 0.5"]


def test_the_comparison_helper_catches_each_kind_of_difference():
    want = {"a": torch.zeros(2, 3), "b": torch.ones(4)}
    assert tasks.state_dict_problems(dict(want), want) == []
    assert tasks.state_dict_problems({"a": want["a"]}, want) == ["missing b"]
    assert tasks.state_dict_problems({**want, "c": want["b"]}, want) == ["unexpected c"]
    assert tasks.state_dict_problems({**want, "b": torch.ones(2, 2)}, want) == [
        "b: (2, 2) torch.float32 != (4,) torch.float32"
    ]
    assert tasks.state_dict_problems({**want, "b": torch.ones(4, dtype=torch.float64)}, want)
    assert tasks.state_dict_problems({**want, "b": "x"}, want) == ["b: a str, not a plain tensor"]
    off = want["a"].clone()
    off[1, 2] = 1e-5
    assert tasks.state_dict_problems({**want, "a": off}, want) == ["a: values differ by 1e-05"]


# ------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def llama():
    return build_family("llama")


def test_a_model_hp_did_not_apply_is_refused_with_a_fix(llama):
    model = llama
    for call in (hp_core.full_state_dict, hp_core.iter_full_state_dict):
        with pytest.raises(hp_core.ExportNotAppliedError) as e:
            call(model)
        msg = str(e.value)
        assert msg.startswith(f"hp_core.{call.__name__}: LlamaForCausalLM was not parallelized")
        assert "Fix: pass the module you gave to hp_core.apply" in msg
        assert style_problems(msg, f"hp_core.{call.__name__}") == []
    with pytest.raises(hp_core.ExportNotAppliedError, match=r"hp_core\.full_state_dict: dict was"):
        hp_core.full_state_dict({})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank0_only": "yes"}, r"rank0_only='yes' is not a bool\.\nFix: pass rank0_only=True"),
        ({"rank0_only": 1}, r"rank0_only=1 is not a bool"),
        ({"device": "nowhere"}, r"device='nowhere' is not a device a full tensor can be held on"),
        ({"device": "meta"}, r"device='meta' is not a device"),
        ({"device": 3.5}, r"device=3.5 is not a device"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(llama, kwargs, message):
    model = llama
    for call in (hp_core.full_state_dict, hp_core.iter_full_state_dict):
        with pytest.raises(
            hp_core.ExportArgumentError, match=f"hp_core.{call.__name__}: {message}"
        ) as e:
            call(model, **kwargs)
        assert style_problems(str(e.value), f"hp_core.{call.__name__}") == []


def test_original_names_of_a_model_hp_did_not_apply_are_its_own(llama):
    names = original_names(llama)
    assert list(names) == list(llama.state_dict())
    assert all(v == (k,) for k, v in names.items())
