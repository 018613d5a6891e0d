"""Sequence layouts, positions and masks (in-process: pure tensor code, no process group)."""

from __future__ import annotations

import pytest
import torch
from hp_plugin_cp.layout import combine_masks, narrow_mask

from hp_plugin_cp import (
    CPBatchError,
    CPLayout,
    CPMaskError,
    all_gather_kv,
    chunk_positions,
    expand_kv_heads,
    gathered_positions,
    shard_sequence,
    unshard_sequence,
)


def test_contiguous_positions():
    assert chunk_positions(1, 2, 4, load_balanced=False).tolist() == [4, 5, 6, 7]
    assert gathered_positions(2, 4, load_balanced=False).tolist() == list(range(8))


def test_load_balanced_positions_pair_a_head_and_a_tail_chunk():
    # cp=2, 8 tokens → 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert chunk_positions(0, 2, 4, load_balanced=True).tolist() == [0, 1, 6, 7]
    assert chunk_positions(1, 2, 4, load_balanced=True).tolist() == [2, 3, 4, 5]
    assert gathered_positions(2, 4, load_balanced=True).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


def test_load_balanced_evens_out_causal_work():
    """The point of the layout: every rank sees the same number of (query, key) pairs."""

    def work(lb: bool) -> list[int]:
        return [
            int((chunk_positions(r, 4, 8, load_balanced=lb)[:, None] >= torch.arange(32)).sum())
            for r in range(4)
        ]

    assert len(set(work(True))) == 1
    assert work(False) == sorted(work(False)) and work(False)[0] < work(False)[-1]


@pytest.mark.parametrize("lb", [False, True])
def test_shard_then_unshard_is_the_identity(lb):
    x = torch.arange(2 * 12 * 3).view(2, 12, 3)
    parts = [shard_sequence(x, 1, r, 3, load_balanced=lb) for r in range(3)]
    assert all(p.shape == (2, 4, 3) for p in parts)
    assert torch.equal(unshard_sequence(torch.cat(parts, dim=1), 1, 3, load_balanced=lb), x)


@pytest.mark.parametrize(("seq", "lb", "chunks"), [(15, False, 2), (10, True, 4)])
def test_indivisible_sequence_names_the_multiple_to_pad_to(seq, lb, chunks):
    with pytest.raises(
        CPBatchError,
        match=rf"(?s)length {seq} is not divisible by {chunks}\..*pad_to_multiple_of={chunks}",
    ):
        shard_sequence(torch.zeros(1, seq), 1, 0, 2, load_balanced=lb)


def test_odd_local_length_cannot_be_load_balanced():
    with pytest.raises(CPBatchError, match="even local length"):
        chunk_positions(0, 2, 3, load_balanced=True)


def test_layout_rejects_a_rank_outside_the_group():
    with pytest.raises(CPBatchError, match=r"cp_rank 2 is outside \[0, 2\)"):
        CPLayout(2, 2, 8)


def _brute_force_mask(layout: CPLayout, pad: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """Single-device mask rows of this rank's tokens, columns in gather order."""
    q_pos, k_pos = layout.query_positions(), layout.key_positions()
    full = torch.ones(layout.seq_len, layout.seq_len, dtype=torch.bool)
    if causal:
        full = full.tril()
    out = full[q_pos][:, k_pos][None, None]
    if pad is not None:
        out = out & pad.bool()[:, k_pos][:, None, None, :]
    return out


@pytest.mark.parametrize("lb", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_layout_mask_equals_the_single_device_mask(lb, rank, causal):
    pad = torch.ones(2, 8, dtype=torch.long)
    pad[0, :3] = 0
    layout = CPLayout(2, rank, 8, lb, pad)
    got = layout.mask(causal, torch.device("cpu"), where="t")
    want = _brute_force_mask(layout, pad, causal)[..., : layout.visible_keys(causal)]
    assert torch.equal(got.expand_as(want), want)
    assert layout.mask(causal, torch.device("cpu"), where="t") is got  # cached for every layer


def test_contiguous_causal_drops_future_ranks_keys():
    assert CPLayout(4, 1, 16).visible_keys(True) == 8
    assert CPLayout(4, 1, 16).visible_keys(False) == 16
    assert CPLayout(4, 1, 16, load_balanced=True).visible_keys(True) == 16
    assert CPLayout(2, 0, 8).mask(False, torch.device("cpu"), where="t") is None


def test_narrow_4d_masks_rows_and_keys():
    q_pos, k_pos = torch.tensor([2, 3]), torch.tensor([0, 1, 2, 3])
    full = torch.arange(16).view(1, 1, 4, 4) % 3 == 0
    assert torch.equal(narrow_mask(full, q_pos, k_pos, 4, where="t"), full[:, :, 2:])
    rows = full[:, :, 2:]  # already this rank's rows
    assert torch.equal(narrow_mask(rows, q_pos, k_pos, 4, where="t"), rows)
    additive = torch.zeros(1, 1, 4, 4).masked_fill(~full, float("-inf"))
    narrowed = narrow_mask(additive, q_pos, k_pos, 4, where="t")
    assert narrowed.dtype == torch.float32 and torch.equal(narrowed, additive[:, :, 2:])
    causal = (k_pos[None] <= q_pos[:, None])[None, None]
    both = combine_masks(narrowed, causal)
    assert torch.equal(torch.isinf(both), torch.isinf(additive[:, :, 2:]) | ~causal)


@pytest.mark.parametrize("shape", [(2, 4), (1, 1, 4, 2), (1, 4), (4,)])
def test_masks_of_the_local_chunk_are_refused(shape):
    with pytest.raises(CPMaskError, match=r"global keys|whole sequence"):
        narrow_mask(
            torch.ones(shape, dtype=torch.bool), torch.tensor([0, 1]), torch.arange(8), 8, where="w"
        )


def test_expand_kv_heads_matches_hf_repeat_kv():
    from transformers.integrations.sdpa_attention import repeat_kv

    k = torch.randn(2, 2, 5, 3)
    assert torch.equal(expand_kv_heads(k, 4, where="t"), repeat_kv(k, 2))
    assert expand_kv_heads(k, 2, where="t") is k
    with pytest.raises(CPBatchError, match="not a multiple"):
        expand_kv_heads(k, 3, where="t")


def test_packed_kv_needs_matching_leading_dims():
    with pytest.raises(ValueError, match="one packed collective"):
        all_gather_kv(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 3, 8), group=None)
