"""Checked DCP loads: a bad checkpoint is a clear error on every rank and loses nothing.

``hp_core.load_checkpoint`` checks a checkpoint against the model before it reads a value,
loads into staging copies, and copies into the model only when every rank succeeded. One
gloo world (tp=2, production) runs every case (``dist_tasks_checkpoint_errors``); each
test here asserts one of them: the error's class and message on every rank, and that every
rank's parameters, buffers and optimizer state are bit-identical to before the call.
"""

from __future__ import annotations

import pytest

from hp_core.testing import get_world
from tests.test_error_style import style_problems
from tests import dist_tasks_checkpoint_errors as tasks

pytestmark = pytest.mark.distributed


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
        assert not style_problems(message, message.partition(":")[0]), error
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
    assert ranks[1]["unchanged"]["in_place"] is True  # rank 1 failed at its first item


def test_a_fresh_optimizer_keeps_no_state_from_a_failed_load(ranks):
    for r in ranks:
        assert r["errors"]["fresh_optimizer"].startswith("CheckpointCorruptError: ")
        assert r["fresh_state_after"] == 0


def test_optimizer_state_round_trips_in_validate_mode(tmp_path):
    for r in get_world(2).run(tasks.optimizer_round_trip, str(tmp_path / "opt")):
        assert r["before"] > 0.05 and r["keys"], r
        assert r["after"] == 0.0, r
