"""``hp_core.load_pretrained``: a Hugging Face checkpoint onto a meta-built, applied model.

Checkpoints are written in ``tmp_path`` by ``save_pretrained`` of the seeded single-device
model (one file, or sharded with a small ``max_shard_size``). On real gloo worlds the model
is built on meta, planned, applied (tp production and validate, cp, ep, FSDP2 on dp after
the load), loaded; then every parameter, the logits and the loss equal the single-device
model's, the rotary buffers are recomputed, tied weights are one object, and each rank
read exactly its own shard's bytes (``read_slice`` is wrapped to count them). In
torchtitan's order (apply, ``fully_shard`` on meta, load) at dp=2 x tp=2 each rank reads
only FSDP's piece, uneven splits included, and one AdamW step equals the single-device
step. Every bad input is refused with its own error, and the model stays on meta.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hp_core.testing import get_world
from hp_core.testing.families import build_family
from tests import dist_tasks_pretrained as tasks
from tests.test_error_style import style_problems

pytestmark = pytest.mark.distributed

TOL = 1e-6
TIED = {"tie_word_embeddings": True}
# Tied, and 130 rows per tp=2 shard of 65: FSDP's dp=2 split is 33 + 32 rows (padded).
UNEVEN = {**TIED, "intermediate_size": 130, "vocab_size": 130}
MODEL_CASES = {"materialised", "not_applied"}


def _save(family: str, path: Path, **kw: object) -> str:
    overrides = kw.pop("overrides", {})
    build_family(family, seed=0, **overrides).save_pretrained(path, **kw)  # type: ignore[arg-type]
    return str(path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pretrained")
    return {
        "llama": _save("llama", root / "llama"),
        "llama_sharded": _save("llama", root / "llama_sharded", max_shard_size="40KB"),
        "tied": _save("llama", root / "tied", overrides=TIED),
        "uneven": _save("llama", root / "uneven", overrides=UNEVEN),
        "gemma": _save("gemma", root / "gemma"),
        "moe": _save("qwen2_moe", root / "moe", max_shard_size="40KB"),
    }


def _check_equal(r: dict, replicated: set[str] | None = None) -> None:
    assert r["meta_before"] and r["same_objects"], r  # filled in place, same objects
    assert max(r["params"].values()) <= TOL, {k: v for k, v in r["params"].items() if v > TOL}
    assert r["logits"] <= 1e-5, r
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 and r["loss"] == r["loss"], r  # finite
    assert r["inv_freq"] == 0.0, r
    # Each rank read its shard's bytes and nothing more, and no sharded tensor whole.
    assert r["read_bytes"] == r["local_bytes"], r
    assert not set(r["read_full"]) & set(r["sharded"]), r
    if replicated is not None:
        assert set(r["read_full"]) == replicated, r


NORMS = {
    *(
        f"model.layers.{i}.{n}.weight"
        for i in (0, 1)
        for n in ("input_layernorm", "post_attention_layernorm")
    ),
    "model.norm.weight",
}


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_tp2_single_file_matches_one_device(ckpts, mode):
    for r in get_world(2).run(tasks.load_and_compare, ckpts["llama"], "llama", {"tp": 2}, mode):
        _check_equal(r, NORMS)
        assert "model.layers.0.self_attn.q_proj.weight" in r["sharded"]


def test_tp2_sharded_checkpoint(ckpts):
    assert (Path(ckpts["llama_sharded"]) / "model.safetensors.index.json").is_file()
    for r in get_world(2).run(tasks.load_and_compare, ckpts["llama_sharded"], "llama", {"tp": 2}):
        _check_equal(r, NORMS)


def test_tied_weights_stay_tied(ckpts):
    for r in get_world(2).run(
        tasks.load_and_compare, ckpts["tied"], "llama", {"tp": 2}, "production", TIED
    ):
        _check_equal(r, NORMS)
        assert r["tied"], r  # lm_head.weight is embed_tokens.weight


def test_checkpoint_without_the_model_prefix(tmp_path):
    """A bare LlamaModel's save_pretrained has no ``model.`` prefix; the tied head follows."""
    build_family("llama", seed=0, **TIED).model.save_pretrained(tmp_path)
    keys = load_file(tmp_path / "model.safetensors")
    assert "embed_tokens.weight" in keys and "lm_head.weight" not in keys
    for r in get_world(2).run(
        tasks.load_and_compare, str(tmp_path), "llama", {"tp": 2}, "production", TIED
    ):
        _check_equal(r)
        assert r["tied"], r


def test_gemma_scaled_embedding_buffer_is_recomputed(ckpts):
    for r in get_world(2).run(tasks.load_and_compare, ckpts["gemma"], "gemma", {"tp": 2}):
        _check_equal(r)


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_ep2_reads_only_its_experts(ckpts, mode):
    results = get_world(2).run(
        tasks.load_and_compare, ckpts["moe"], "qwen2_moe", {"tp": 2}, mode, None, 2
    )
    for rank, r in enumerate(results):
        _check_equal(r)
        # save_pretrained writes one tensor per expert; 4 experts, ep=2: rank r owns 2r, 2r+1.
        experts = {int(k.split(".")[5]) for k in r["read_keys"] if ".mlp.experts." in k}
        assert experts == {2 * rank, 2 * rank + 1}, (rank, experts)
        if mode == "production":
            assert "model.layers.0.mlp.experts.gate_up_proj" in r["sharded"]


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_hp_stacked_experts_load_from_per_expert_keys(tmp_path, mode):
    """hp's own stacks (a ModuleList of experts at ep=2): the per-expert checkpoint keys
    fill the stacked parameter, each rank reading only its two of the four experts."""
    from tests._toy_models import list_moe_lm

    torch.manual_seed(0)
    save_file(
        {k: v.contiguous() for k, v in list_moe_lm().state_dict().items()},
        str(tmp_path / "model.safetensors"),
    )
    results = get_world(2).run(tasks.hp_stacked_experts, str(tmp_path), mode)
    for rank, r in enumerate(results):
        assert r["local_shape"] == (2, 32, 64), r  # stacked: this rank's [E / ep, ffn, hidden]
        assert r["experts_read"] == [2 * rank, 2 * rank + 1], r
        assert r["keys"] and r["values"] <= 1e-6 and r["logits"] <= 1e-5, r


def test_cp2_replicated_parameters_read_whole(ckpts):
    for r in get_world(2).run(tasks.cp_load, ckpts["llama"]):
        assert r["params"] <= TOL and abs(r["loss"] - r["ref_loss"]) <= 1e-5, r
        assert r["read_bytes"] == r["total_bytes"], r  # cp replicates every parameter


def test_fsdp2_on_dp_after_the_load(ckpts):
    results = get_world(4).run(
        tasks.load_and_compare,
        ckpts["llama"],
        "llama",
        {"dp": 2, "tp": 2},
        "production",
        None,
        1,
        True,
    )
    for r in results:
        _check_equal(r, NORMS)


@pytest.fixture(scope="module")
def fsdp_first(ckpts) -> list[dict]:
    return get_world(4).run(tasks.load_after_fully_shard, ckpts["llama"], ckpts["uneven"], UNEVEN)


@pytest.mark.parametrize("case", ["untied", "tied_uneven"])
def test_load_after_fully_shard_reads_only_fsdps_piece(fsdp_first, case):
    """apply -> fully_shard on meta -> load_pretrained (dp=2 x tp=2): every parameter, the
    logits, the loss and one AdamW step equal the single-device model's, and each rank
    read exactly its FSDP piece: a quarter of the model, half of every norm; with uneven
    splits, FSDP's 33 or 32 rows of hp's 65."""
    results = [result[case] for result in fsdp_first]
    norms = len(NORMS) * 64 * 4  # hidden 64, fp32; hp replicates them over tp
    # All ranks together read the model once, and each norm once per tp rank.
    assert sum(r["read_bytes"] for r in results) == results[0]["model_bytes"] + norms
    for rank, r in enumerate(results):
        assert r["meta_before"] and r["same_objects"] and r["all_fsdp"], r
        assert max(r["params"].values()) <= TOL, {k: v for k, v in r["params"].items() if v > TOL}
        assert r["logits"] <= 1e-5 and abs(r["loss"] - r["ref_loss"]) <= 1e-5, r
        assert r["inv_freq"] == 0.0, r
        # AdamW's first step is +-lr (1e-3) wherever |grad| >> eps, so rounding in a grad
        # of ~1e-7 moves an element by a fraction of lr; a missed or misplaced update by lr.
        assert r["moved"] > 5e-4 and r["stepped"] <= 1e-4, r  # the step moved every tensor
        assert abs(r["loss2"] - r["ref_loss2"]) <= 1e-5 and r["loss2"] < r["loss"], r
        assert r["read_bytes"] == r["local_bytes"], r
        assert r["read_full"] == [], r  # FSDP shards the norms hp replicates
        for norm in NORMS:
            assert r["read"][norm] == 64 * 4 // 2, (norm, r["read"])
        if case == "untied":  # even: hp's and FSDP's splits leave a quarter to each rank
            assert r["read_bytes"] == (r["model_bytes"] - norms) // 4 + norms // 2, r
        else:  # rank = 2 * dp + tp; dp rank 0 holds FSDP's padded 33 rows, dp rank 1 32
            rows = 33 if rank < 2 else 32
            assert r["read"]["model.layers.0.mlp.gate_proj.weight"] == rows * 64 * 4, r["read"]
            assert r["read"]["model.embed_tokens.weight"] == rows * 64 * 4, r["read"]
        assert r["tied"] == (case == "tied_uneven"), r


def test_a_read_failing_after_fully_shard_loads_nothing_anywhere(fsdp_first):
    """hp applied on the tp slice, FSDP on dp: rank 1's read fails, and the ranks of the
    other tp group (2, 3) refuse too: the agreement covers FSDP's dp as well as hp's mesh."""
    errors = [r["read_fails"]["error"] for r in fsdp_first]
    assert "failed on this rank (OSError: disk went away)" in errors[1], errors
    assert all(e.startswith("CheckpointReadError: ") for e in errors), errors
    assert "failed on another rank" in errors[0] and "failed on another rank" in errors[3]
    for r in fsdp_first:
        assert r["read_fails"]["unchanged"] and r["read_fails"]["still_meta"], r["read_fails"]


def test_fsdp_over_a_parameter_hp_did_not_lay_out_refused(fsdp_first):
    """q_proj swapped for a whole (64, 64) tensor after apply: FSDP wraps a tensor that is
    not hp's (32, 64) shard, so its pieces say nothing about where they sit."""
    for r in fsdp_first:
        assert r["reshaped"]["unchanged"] and r["reshaped"]["still_meta"], r["reshaped"]
        e = r["reshaped"]["error"]
        key = "model.layers.0.self_attn.q_proj.weight"
        assert e.startswith(f"FsdpViewError: {key}: FSDP2's DTensor has the global shape "), e
        assert "(64, 64), but hp's shard of (64, 64) as {dp: replicate, tp: shard(0)}" in e, e
        assert not style_problems(e.split(": ", 1)[1], key), style_problems(e, key)


def test_validate_mode_after_fully_shard_refused(fsdp_first):
    for r in fsdp_first:
        assert r["validate"]["unchanged"] and r["validate"]["still_meta"], r["validate"]
        e = r["validate"]["error"]
        assert e.startswith(
            "NotOnMetaError: FSDPLlamaForCausalLM: FSDP2 (fully_shard) already wraps this "
            "validate-mode model"
        ), e
        message = e.split(": ", 1)[1]
        assert not style_problems(message, "FSDPLlamaForCausalLM"), style_problems(
            message, "FSDPLlamaForCausalLM"
        )


def test_a_perturbed_tensor_is_caught(ckpts, tmp_path):
    """Negative control: the comparison the tests above rely on names a wrong tensor."""
    shutil.copytree(ckpts["llama"], tmp_path / "bad")
    file = tmp_path / "bad" / "model.safetensors"
    state = load_file(file)
    state["model.layers.1.mlp.down_proj.weight"][3, 5] += 0.01
    save_file(state, file, metadata={"format": "pt"})
    for r in get_world(2).run(tasks.perturbed_is_caught, str(tmp_path / "bad"), "llama"):
        assert r["bad"] == ["model.layers.1.mlp.down_proj.weight"], r


def test_cast_true_loads_a_bf16_checkpoint(ckpts, tmp_path):
    state = {
        k: v.to(torch.bfloat16)
        for k, v in load_file(Path(ckpts["llama"]) / "model.safetensors").items()
    }
    shutil.copy(Path(ckpts["llama"]) / "config.json", tmp_path / "config.json")
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for r in get_world(2).run(tasks.cast_load, str(tmp_path)):
        assert r["params"] == 0.0 and r["dtypes"] == ["torch.float32"], r


# ----------------------------------------------------------------- bad input, one error each


def _rewrite(src: str, dst: Path, edit) -> str:
    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    state = load_file(file)
    edit(state)
    save_file(state, file, metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def refused(ckpts, tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("bad")
    llama = ckpts["llama"]
    q = "model.layers.0.self_attn.q_proj.weight"
    truncated = Path(shutil.copytree(llama, root / "truncated"))
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-100])
    corrupt = Path(shutil.copytree(llama, root / "corrupt"))
    (length,) = struct.unpack("<Q", data[:8])
    (corrupt / "model.safetensors").write_bytes(data[:8] + b"{" * length + data[8 + length :])
    no_shard = Path(shutil.copytree(ckpts["llama_sharded"], root / "no_shard"))
    shard = sorted(
        set(
            json.loads((no_shard / "model.safetensors.index.json").read_text())[
                "weight_map"
            ].values()
        )
    )[1]
    (no_shard / shard).unlink()
    other = Path(shutil.copytree(llama, root / "other"))
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    foreign = root / "foreign"
    foreign.mkdir()
    save_file(
        {"wte.weight": torch.zeros(4, 4), "h.0.attn.c_attn.weight": torch.zeros(4, 4)},
        foreign / "model.safetensors",
    )
    ragged = root / "ragged"  # expert 3 lacks its up projection
    build_family("qwen2_moe", seed=0).save_pretrained(ragged)
    state = load_file(ragged / "model.safetensors")
    del state["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(state, ragged / "model.safetensors", metadata={"format": "pt"})
    empty = root / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no weights here")
    cases = {
        "missing": (
            _rewrite(llama, root / "missing", lambda s: s.pop("model.layers.1.mlp.up_proj.weight")),
            "",
        ),
        "unexpected": (
            _rewrite(
                llama,
                root / "unexpected",
                lambda s: s.update({"model.extra.weight": torch.zeros(3)}),
            ),
            "",
        ),
        "dtype": (
            _rewrite(llama, root / "dtype", lambda s: s.update({q: s[q].to(torch.bfloat16)})),
            "",
        ),
        "shape": (
            _rewrite(llama, root / "shape", lambda s: s.update({q: s[q][:, :60].contiguous()})),
            "",
        ),
        "other_model": (str(other), ""),
        "foreign_keys": (str(foreign), ""),
        "truncated": (str(truncated), ""),
        "corrupt": (str(corrupt), ""),
        "missing_shard": (str(no_shard), ""),
        "ragged_experts": (str(ragged), "moe"),
        "no_path": (str(root / "nowhere"), ""),
        "no_safetensors": (str(empty), ""),
        "materialised": (llama, "materialised"),
        "not_applied": (llama, "not_applied"),
        "read_fails": (llama, "fail_rank1"),
        "no_buffer_init": (llama, "no_buffer_init"),
    }
    results = get_world(2).run(tasks.refusals, cases)
    out = {}
    for name in cases:
        for r in results:
            assert r[name]["unchanged"] and (r[name]["still_meta"] or name == "materialised"), (
                name,
                r[name],
            )
            assert r[name]["error"] is not None, (name, r[name])
            # hp's error shape: the first line names the culprit (the checkpoint, or the
            # model when the model is what is wrong), then the rule, then "Fix: ...".
            culprit = "LlamaForCausalLM" if cases[name][1] in MODEL_CASES else cases[name][0]
            message = r[name]["error"].split(": ", 1)[1]
            assert not style_problems(message, culprit), (name, style_problems(message, culprit))
        out[name] = {"errors": [r[name]["error"] for r in results], "root": str(root)}
    return out


def _error(refused: dict, name: str, rank: int = 0) -> str:
    return refused[name]["errors"][rank]


def test_missing_key(refused):
    e = _error(refused, "missing")
    assert e.startswith("CheckpointKeysMissingError: ") and "missing/model.safetensors" not in e
    assert "no tensor for 1 model keys: model.layers.1.mlp.up_proj.weight." in e, e


def test_unexpected_key(refused):
    e = _error(refused, "unexpected")
    assert e.startswith("CheckpointUnexpectedKeysError: ") and "unexpected" in e
    assert (
        "1 checkpoint tensors match no parameter or buffer of LlamaForCausalLM: model.extra.weight"
        in e
    ), e


def test_dtype_mismatch(refused):
    e = _error(refused, "dtype")
    assert e.startswith("CheckpointDtypeError: ") and "dtype/model.safetensors" in e, e
    assert "model.layers.0.self_attn.q_proj.weight is torch.bfloat16, but the model's" in e, e
    assert "cast=True" in e


def test_shape_mismatch(refused):
    e = _error(refused, "shape")
    assert e.startswith("CheckpointShapeError: ") and "shape/model.safetensors" in e, e
    assert (
        "makes a tensor of shape (64, 60), but the model's "
        "model.layers.0.self_attn.q_proj.weight is (64, 64) as {tp: shard(0)}" in e
    ), e


def test_an_expert_missing_a_projection(refused):
    e = _error(refused, "ragged_experts")
    assert e.startswith("CheckpointShapeError: ") and "ragged/model.safetensors: 7 stacked" in e, e
    assert "for the model's model.layers.0.mlp.experts.gate_up_proj do not stack: experts [3]" in e


def test_checkpoint_of_another_model_type(refused):
    e = _error(refused, "other_model")
    assert (
        e.startswith("CheckpointModelMismatchError: ") and "a checkpoint of a 'gpt2' model" in e
    ), e


def test_checkpoint_with_another_models_keys(refused):
    e = _error(refused, "foreign_keys")
    assert e.startswith("CheckpointModelMismatchError: ") and "holds 0 of the" in e, e
    assert "wte.weight" in e


def test_truncated_file(refused):
    e = _error(refused, "truncated")
    assert e.startswith("CorruptSafetensorsError: ") and "truncated/model.safetensors" in e, e
    assert "but the file holds only" in e, e


def test_corrupt_header(refused):
    e = _error(refused, "corrupt")
    assert e.startswith("CorruptSafetensorsError: ") and "JSON header does not parse" in e, e


def test_missing_shard_file(refused):
    e = _error(refused, "missing_shard")
    assert (
        e.startswith("MissingShardFileError: ") and "named by model.safetensors.index.json" in e
    ), e


def test_path_that_does_not_exist(refused):
    e = _error(refused, "no_path")
    assert (
        e.startswith("CheckpointNotFoundError: ") and "nowhere: no such file or directory" in e
    ), e


def test_directory_without_safetensors(refused):
    e = _error(refused, "no_safetensors")
    assert e.startswith("CheckpointNotFoundError: ") and "notes.txt" in e, e


def test_materialised_model_refused(refused):
    e = _error(refused, "materialised")
    assert e.startswith(
        "NotOnMetaError: LlamaForCausalLM: load_pretrained fills a model built on the meta device"
    ), e


def test_model_hp_did_not_apply_refused(refused):
    e = _error(refused, "not_applied")
    assert e.startswith(
        "NotOnMetaError: LlamaForCausalLM: not a model hp_core.apply parallelized"
    ), e


def test_a_read_failing_on_one_rank_loads_nothing_anywhere(refused):
    """Rank 1's reads fail mid-way, rank 0's succeed: both refuse, both still on meta."""
    assert "failed on this rank (OSError: disk went away)" in _error(refused, "read_fails", 1)
    assert "failed on another rank" in _error(refused, "read_fails", 0)
    assert _error(refused, "read_fails", 0).startswith("CheckpointReadError: ")


def test_buffers_nothing_recomputes_are_refused(refused):
    e = _error(refused, "no_buffer_init")
    assert e.startswith("CheckpointKeysMissingError: ") and "model.rotary_emb.inv_freq" in e, e


def test_a_persistent_buffer_loads_whole(tmp_path):
    reference = build_family("llama", seed=0)
    reference.model.register_buffer("pos_scale", torch.arange(4.0) + 0.5, persistent=True)
    reference.save_pretrained(tmp_path)
    assert "model.pos_scale" in load_file(tmp_path / "model.safetensors")
    for r in get_world(2).run(tasks.persistent_buffer, str(tmp_path)):
        assert r == {"value": [0.5, 1.5, 2.5, 3.5], "device": "cpu"}, r
