"""Checked DCP loads: a bad checkpoint is a clear error on every rank and loses nothing.

``hp_core.load_checkpoint`` checks a checkpoint against the model before it reads a value,
loads into staging copies, and copies into the model only when every rank succeeded. One
gloo world (tp=2, production) runs every case (``dist_tasks_checkpoint_errors``); each
test here asserts one of them: the error's class and message on every rank, and that every
rank's parameters, buffers and optimizer state are bit-identical to before the call.
"""

from __future__ import annotations

import os
import pickle
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

import hp_core
from hp_core.checkpoint import dcp_checks, dcp_io
from hp_core.checkpoint.dcp_agree import unwrap
from hp_core.checkpoint.dcp_checksums import CHECKSUM_FILE, Checksums
from hp_core.checkpoint.dcp_errors import error_class
from hp_core.testing import get_world
from hp_core.testing.families import build_family, family_batch
from tests import dist_tasks_checkpoint_errors as tasks
from tests.test_error_style import style_problems

pytestmark = pytest.mark.distributed  # the world's cases; the one-process ones are at the end


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return get_world(2).run(tasks.checked_loads, str(tmp_path_factory.mktemp("checked")))


def _errors(ranks, case):
    return [r["errors"][case] for r in ranks]


def _refused(ranks, case, cls, *parts):
    """Every rank raised ``cls``, naming ``parts``; every rank's model is bit-identical."""
    for r in ranks:
        error = r["errors"][case]
        assert error is not None and error.startswith(f"{cls}: "), (r["rank"], error)
        message = error.partition(": ")[2].removeprefix(f"rank {1 - r['rank']}: ")
        for part in parts:
            assert part in error, (r["rank"], part, error)
        # The first line names what the case expects first (the key or the file).
        culprit = parts[0].partition(": ")[0]
        assert not style_problems(message, culprit), (culprit, error)
        assert r["unchanged"][case] is True, (r["rank"], case)


def test_round_trip_restores_values_logits_and_extra(ranks):
    for r in ranks:
        assert r["initial_diff"] > 0.05  # negative control: seed 1 differs from seed 0
        assert r["round_trip_diff"] == 0.0 and r["logits_diff"] == 0.0, r
        assert r["extra"] == {"step": 3, "seed": [0, 1, 2, 3]}


def test_a_checkpoint_of_another_config_names_the_keys_shapes_and_layouts(ranks):
    _refused(
        ranks,
        "wider",
        "CheckpointMismatchError",
        "model.layers.0.mlp.gate_proj.weight: the checkpoint",
        "(6 keys)",
        "checkpoint (192, 64) torch.float32, saved as chunks (96, 64) at (0, 0), (96, 64) at "
        "(96, 0); model (128, 64) as {tp: shard(0)} torch.float32",
        "model (64, 128) as {tp: shard(1)}",
        "Fix: build the model with the config the checkpoint was saved from",
    )


def test_a_checkpoint_of_another_family_lists_the_keys_the_model_lacks(ranks):
    _refused(
        ranks,
        "qwen2",
        "CheckpointMismatchError",
        "model.layers.0.self_attn.k_proj.bias: in the checkpoint",
        "(6 unexpected keys: ",
        "model.layers.1.self_attn.v_proj.bias",
    )


def test_a_shape_a_tp2_model_cannot_hold_is_a_global_shape_mismatch(ranks):
    # Saved by one process (tp=1) with 127 tokens; DCP would reshard any layout of the
    # right global shape, so the refusal is about the shape, on every rank.
    _refused(
        ranks,
        "vocab127",
        "CheckpointMismatchError",
        "model.embed_tokens.weight: checkpoint (127, 64)",
        "model (128, 64) as {tp: shard(0)}",
        "lm_head.weight: checkpoint (127, 64)",
    )


def test_missing_unexpected_and_dtype(ranks):
    _refused(
        ranks, "missing", "CheckpointMismatchError", "model.norm.weight: not in the checkpoint"
    )
    _refused(
        ranks,
        "unexpected",
        "CheckpointMismatchError",
        "lm_head.bias: in the checkpoint",
        "pass strict=False",
    )
    _refused(
        ranks,
        "dtype",
        "CheckpointMismatchError",
        f"{tasks.KEY}: checkpoint (64, 64) torch.float64",
        "model (64, 64) as {tp: shard(0)} torch.float32",
    )
    _refused(
        ranks,
        "no_optimizer_state",
        "CheckpointMismatchError",
        "optimizer.state.model.embed_tokens.weight.step: not in the checkpoint",
        "Fix: pass optimizer=None",
    )
    for r in ranks:  # strict=False ignores the unexpected key and loads the rest
        assert r["lenient"] is None and r["lenient_diff"] == 0.0, r


def test_missing_files(ranks):
    _refused(ranks, "deleted", "CheckpointMissingFileError", "distcp: missing; rank")
    _refused(ranks, "no_metadata", "CheckpointMissingFileError", "/.metadata: no such file")
    _refused(
        ranks, "no_directory", "CheckpointMissingFileError", "never_saved/.metadata: the directory"
    )


def test_truncated_and_corrupt_files(ranks):
    _refused(
        ranks,
        "truncated",
        "CheckpointCorruptError",
        f"{ranks[0]['truncated_file']}: truncated:",
        f"{tasks.KEY} is stored at bytes",
    )
    _refused(ranks, "truncated_with_optimizer", "CheckpointCorruptError", "truncated:")
    _refused(ranks, "metadata_checksum", "CheckpointCorruptError", ".metadata: fails its checksum")
    _refused(
        ranks, "metadata_unpicklable", "CheckpointCorruptError", ".metadata: unreadable (Unpickl"
    )
    _refused(ranks, "checksum_file", "CheckpointCorruptError", "hp_checksums.json: unreadable")
    _refused(
        ranks,
        "broken_record",
        "CheckpointCorruptError",
        f".distcp: {tasks.KEY} (bytes ",
        "unreadable",
    )


def test_a_flipped_byte_is_caught_by_the_checksums_and_only_by_them(ranks):
    _refused(
        ranks,
        "flipped",
        "CheckpointCorruptError",
        ".distcp: the bytes of model.norm.weight (at ",
        "fail their checksum",
    )
    for r in ranks:  # without the checksum file the same bytes load, silently wrong
        assert r["silent_flip"] is None and r["silent_flip_diff"] > 0.0, r


def test_a_file_only_one_rank_reads_stops_every_rank(ranks):
    (name, reader), *_ = ranks[0]["read_by_one_rank"]
    _refused(ranks, "one_rank_file_gone", "CheckpointMissingFileError", f"{name}: missing")
    own = ranks[reader]["errors"]["one_rank_file_gone"]
    other = ranks[1 - reader]["errors"]["one_rank_file_gone"]
    assert not own.startswith("CheckpointMissingFileError: rank ")
    assert other.startswith(f"CheckpointMissingFileError: rank {reader}: ")


def test_a_read_failing_on_rank1_only_stops_every_rank_and_changes_nothing(ranks):
    _refused(
        ranks,
        "rank1_read_fails",
        "CheckpointLoadError",
        "reading failed (OSError: [Errno 5] Input/output error (injected))",
    )
    assert ranks[0]["errors"]["rank1_read_fails"].startswith("CheckpointLoadError: rank 1: ")
    # The control: in place (staging=False) rank 0 had already written its values.
    assert _errors(ranks, "in_place")[0].startswith("CheckpointLoadError: rank 1: ")
    assert ranks[0]["unchanged"]["in_place"] is False


def test_a_fresh_optimizer_keeps_no_state_from_a_failed_load(ranks):
    for r in ranks:
        assert r["errors"]["fresh_optimizer"].startswith("CheckpointCorruptError: ")
        assert r["fresh_state_after"] == 0


@pytest.mark.parametrize("mode", ["validate", "production"])
def test_optimizer_state_round_trips(tmp_path, mode):
    for r in get_world(2).run(tasks.optimizer_round_trip, str(tmp_path / "opt"), mode):
        assert r["before"] > 0.05 and r["keys"], r
        assert r["after"] == 0.0, r


# ------------------------------------------------- one process (no process group)


def _llama(seed):
    return build_family("llama", seed=seed)


def _message(fn):
    try:
        fn()
    except hp_core.CheckpointError as err:
        return f"{type(err).__name__}: {err}"
    raise AssertionError("expected a CheckpointError")


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_one_process_round_trip_with_optimizer_and_a_refusal(tmp_path):
    source = _llama(0)
    opt = torch.optim.AdamW(source.parameters(), lr=1e-2)
    source(input_ids=family_batch("llama", batch=1, seq=8)).logits.mean().backward()
    opt.step()
    hp_core.save_checkpoint(tmp_path / "a", source, opt, extra={"epoch": 2})
    model = _llama(1)
    model_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert hp_core.load_checkpoint(tmp_path / "a", model, model_opt) == {"epoch": 2}
    assert all(
        torch.equal(a, b)
        for a, b in zip(_params(source).values(), _params(model).values(), strict=True)
    )
    moments = [s["exp_avg"] for s in model_opt.state.values()]
    assert all(
        torch.equal(a["exp_avg"], b) for a, b in zip(opt.state.values(), moments, strict=True)
    )
    # The reader's error comes straight through in one process; the model keeps its values.
    reader = FileSystemReader(str(tmp_path / "a"))
    info = next(v for k, v in reader.read_metadata().storage_data.items() if k.fqn == tasks.KEY)
    path = tmp_path / "a" / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + info.length - 22 : info.offset + info.length] = b"\0" * 22
    path.write_bytes(bytes(data))
    fresh, before = _llama(2), _params(_llama(2))
    error = _message(lambda: hp_core.load_checkpoint(tmp_path / "a", fresh))
    assert error.startswith("CheckpointCorruptError: ") and "fail their checksum" in error
    assert _equal(before, _params(fresh))


def test_save_without_checksums_and_load_in_place(tmp_path):
    hp_core.save_checkpoint(tmp_path / "plain", _llama(3))
    assert (tmp_path / "plain" / CHECKSUM_FILE).exists()
    # Saving again over it without checksums drops the old ones (they would refuse it).
    hp_core.save_checkpoint(tmp_path / "plain", _llama(0), checksums=False)
    assert not (tmp_path / "plain" / CHECKSUM_FILE).exists()
    model = _llama(1)
    hp_core.load_checkpoint(tmp_path / "plain", model, staging=False)
    assert all(
        torch.equal(a, b)
        for a, b in zip(_params(_llama(0)).values(), _params(model).values(), strict=True)
    )


def test_save_refuses_reserved_model_keys_and_nested_extra(tmp_path):
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.optimizer = nn.Linear(2, 2)

    error = _message(lambda: hp_core.save_checkpoint(tmp_path / "x", Holder()))
    assert error.startswith("CheckpointMismatchError: optimizer.bias: a model key under")
    error = _message(
        lambda: hp_core.save_checkpoint(tmp_path / "y", nn.Linear(2, 2), extra={"s": {"a": 1}})
    )
    assert error.startswith("CheckpointMismatchError: extra['s']: a mapping") and "Fix:" in error
    tensors = {"t": [torch.zeros(1)], "fine": [1, 2]}
    error = _message(
        lambda: hp_core.save_checkpoint(tmp_path / "z", nn.Linear(2, 2), extra=tensors)
    )
    assert error.startswith("CheckpointMismatchError: extra['t']: a mapping or a sequence")


def test_unexpected_failures_are_checkpoint_load_errors(tmp_path, monkeypatch):
    hp_core.save_checkpoint(tmp_path / "c", _llama(0))
    model = _llama(1)
    before = _params(model)

    def broken(*_args, **_kwargs):
        raise KeyError("planner")

    monkeypatch.setattr(dcp_io, "planned_reads", broken)
    error = _message(lambda: hp_core.load_checkpoint(tmp_path / "c", model))
    assert "the checks before loading failed (KeyError: 'planner')" in error
    monkeypatch.undo()
    monkeypatch.setattr(dcp_io.dcp, "load", broken)
    error = _message(lambda: hp_core.load_checkpoint(tmp_path / "c", model))
    assert error.startswith("CheckpointLoadError: ") and "reading failed (KeyError" in error
    monkeypatch.undo()
    # A storage file that vanishes after the checks (another process deleted it).
    vanish = lambda root, reads, rank: [os.remove(os.path.join(root, r.file)) for r in reads[:1]]  # noqa: E731
    monkeypatch.setattr(dcp_io, "check_files", vanish)
    error = _message(lambda: hp_core.load_checkpoint(tmp_path / "c", model))
    assert error.startswith("CheckpointMissingFileError: ") and "vanished while" in error
    assert _equal(before, _params(model))


def test_failures_gathered_by_dcp_are_named_by_their_rank():
    seen_from_0 = unwrap({1: (RuntimeError("planner broke"), None)}, "/ckpt")
    assert isinstance(seen_from_0, hp_core.CheckpointLoadError)
    assert str(seen_from_0).startswith("rank 1: /ckpt: the checkpoint load failed (RuntimeError")
    own = hp_core.CheckpointCorruptError("/ckpt/x: bad.\nFix: restore it.")
    assert unwrap({0: (own, None)}, "/ckpt") is own
    other = unwrap({1: (own, None)}, "/ckpt")
    assert type(other) is hp_core.CheckpointCorruptError and str(other).startswith("rank 1: /ckpt")
    assert error_class("SomethingElse") is hp_core.CheckpointLoadError


def test_the_classes_are_hp_errors_and_builtin_types():
    assert issubclass(hp_core.CheckpointMismatchError, (hp_core.CheckpointError, ValueError))
    assert issubclass(hp_core.CheckpointMissingFileError, FileNotFoundError)
    assert issubclass(hp_core.CheckpointCorruptError, ValueError)
    for cls in (hp_core.CheckpointLoadError, hp_core.CheckpointMismatchError):
        assert issubclass(cls, hp_core.HpError) and issubclass(cls, RuntimeError)


def _metadata(md):
    return Metadata(state_dict_metadata={"w": md}, storage_data={})


def test_metadata_that_does_not_cover_a_tensor_or_is_not_metadata(tmp_path):
    half = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size([4]),
        [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2]))],
    )
    error = _message(
        lambda: dcp_checks.check_fit(
            "/c", _metadata(half), {"w": torch.zeros(4)}, strict=True, ignored_prefixes=()
        )
    )
    assert error.startswith("CheckpointCorruptError: w: /c/.metadata lists chunks of 2 elements")
    error = _message(
        lambda: dcp_checks.check_fit(
            "/c",
            _metadata(BytesStorageMetadata()),
            {"w": torch.zeros(4)},
            strict=True,
            ignored_prefixes=(),
        )
    )
    assert "w: checkpoint an object (not a tensor); model (4,) torch.float32" in error
    tmp_path.joinpath(".metadata").write_bytes(pickle.dumps(SimpleNamespace(storage_meta=None)))
    error = _message(lambda: dcp_checks.read_metadata(str(tmp_path), None))
    assert (
        error.startswith("CheckpointCorruptError: ")
        and "holds a SimpleNamespace, not DCP metadata" in error
    )


def test_an_item_without_a_checksum_is_refused():
    sums = Checksums("/c/hp_checksums.json", 0, {})
    error = _message(lambda: sums.check_item("/c/f.distcp", "f.distcp", 0, 4, b"abcd", "w"))
    assert error.startswith("CheckpointCorruptError: /c/f.distcp: w is stored at bytes 0..4")
