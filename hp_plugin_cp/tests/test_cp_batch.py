"""``shard_batch_for_cp``: what each rank gets (in-process; the helper never communicates)."""

from __future__ import annotations

import pytest
import torch

from hp_plugin_cp import CP_LAYOUT_KEY, CPBatchError, CPLayout, shard_batch_for_cp


class CPRank:
    """Rank ``rank`` of a cp group of ``size``: all that the batch helper reads from a mesh."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self._size = rank, size

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self.rank


def _batch(seq: int = 8) -> dict:
    ids = torch.arange(2 * seq).view(2, seq)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, -3:] = 0
    return {
        "input_ids": ids,
        "labels": ids.masked_fill(mask == 0, -100),
        "attention_mask": mask,
        "use_cache": False,
    }


def test_contiguous_shards_and_global_positions():
    batch = _batch()
    parts = [shard_batch_for_cp(batch, CPRank(r, 2)) for r in range(2)]
    assert torch.equal(parts[1]["input_ids"], batch["input_ids"][:, 4:])
    assert parts[1]["position_ids"].tolist() == [[4, 5, 6, 7]]
    assert parts[0]["use_cache"] is False  # other keys pass through
    assert "attention_mask" not in parts[0]  # the model-level code would build a local mask from it


def test_labels_are_shifted_before_sharding_so_no_chunk_edge_loses_its_label():
    batch = _batch()
    parts = [shard_batch_for_cp(batch, CPRank(r, 2)) for r in range(2)]
    joined = torch.cat([p["shift_labels"] for p in parts], dim=1)
    expected = torch.cat([batch["labels"][:, 1:], torch.full((2, 1), -100)], dim=1)
    assert torch.equal(joined, expected)
    assert (
        parts[0]["shift_labels"][0, -1] == batch["labels"][0, 4]
    )  # the edge token's label survived
    assert torch.equal(parts[0]["labels"], batch["labels"][:, :4])
    assert int(parts[0]["num_items_in_batch"]) == int((expected != -100).sum()) == 11


def test_load_balanced_shards_and_layout():
    batch = _batch()
    part = shard_batch_for_cp(batch, CPRank(0, 2), load_balanced=True)
    assert part["input_ids"][0].tolist() == [0, 1, 6, 7]
    assert part["position_ids"].tolist() == [[0, 1, 6, 7]]
    layout = part[CP_LAYOUT_KEY]
    assert isinstance(layout, CPLayout)
    assert (layout.cp_size, layout.cp_rank, layout.seq_len, layout.load_balanced) == (2, 0, 8, True)
    assert layout.attention_mask is batch["attention_mask"]  # the *global* mask, for the wrappers


def test_given_position_ids_and_counts_are_kept():
    batch = {
        **_batch(),
        "position_ids": torch.arange(8).flip(0)[None],
        "num_items_in_batch": torch.tensor(99),
    }
    part = shard_batch_for_cp(batch, CPRank(1, 2))
    assert part["position_ids"].tolist() == [[3, 2, 1, 0]]
    assert int(part["num_items_in_batch"]) == 99


def test_inputs_embeds_and_seq_dim():
    embeds = torch.randn(8, 2, 5)  # sequence first
    part = shard_batch_for_cp({"inputs_embeds": embeds}, CPRank(1, 2), seq_dim=0)
    assert torch.equal(part["inputs_embeds"], embeds[4:])
    assert "shift_labels" not in part


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"input_ids": torch.zeros(2, 7, dtype=torch.long)}, "length 7 is not divisible by 2"),
        ({"labels": torch.zeros(2, 8)}, "needs input_ids or inputs_embeds"),
        (
            {"input_ids": torch.zeros(2, 8), "labels": torch.zeros(2, 6)},
            r"batch\['labels'\] has shape \(2, 6\)",
        ),
        (
            {"input_ids": torch.zeros(2, 8), "attention_mask": torch.ones(2, 4)},
            "over the whole sequence",
        ),
        ({"input_ids": torch.zeros(2, 8), CP_LAYOUT_KEY: None}, "sharded already"),
    ],
    ids=["indivisible", "no-ids", "labels-shape", "local-mask", "twice"],
)
def test_batch_errors(batch, match):
    with pytest.raises(CPBatchError, match=match):
        shard_batch_for_cp(batch, CPRank(0, 2))


def test_not_a_mapping():
    with pytest.raises(CPBatchError, match="mapping"):
        shard_batch_for_cp([torch.zeros(2, 8)], CPRank(0, 2))
