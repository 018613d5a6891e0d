"""Shard a training batch for context parallelism, and put the pieces back together.

Under CP every rank runs the model on its chunk of the sequence, so the model-level code
(embedding, rotary positions, mask creation, loss) only ever sees the local chunk. The
helper fixes what that would break:

* ``position_ids`` are the *global* positions of the local tokens (created as
  ``arange(seq_len)`` when absent), so rotary embeddings are right;
* ``labels`` are shifted *before* sharding into ``shift_labels`` (HF's causal-LM loss
  takes them as is), so the token at every chunk edge keeps its label;
  ``num_items_in_batch`` is the global count of labelled tokens, so each rank's loss is
  its share of the global mean;
* ``attention_mask`` is **not** passed to the model: its mask creation would build a mask
  of the local chunk. The global mask travels in the :class:`~hp_plugin_cp.layout.CPLayout`
  under key ``hp_cp``, which HF forwards (``**kwargs``) to the attention wrappers and the loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hp_plugin_cp.errors import CPBatchError
from hp_plugin_cp.layout import (
    CP_LAYOUT_KEY,
    CPLayout,
    local_length,
    shard_sequence,
    unshard_sequence,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["SEQUENCE_KEYS", "gather_sequence", "shard_batch_for_cp"]

#: Batch keys sharded along the sequence dim (``position_ids`` along its last dim).
SEQUENCE_KEYS = (
    "input_ids",
    "inputs_embeds",
    "labels",
    "shift_labels",
    "position_ids",
    "token_type_ids",
)


def _shift(labels: torch.Tensor, dim: int, ignore_index: int) -> torch.Tensor:
    """``labels`` shifted left by one along ``dim``, the last position ``ignore_index``."""
    tail = torch.full_like(labels.narrow(dim, 0, 1), ignore_index)
    return torch.cat([labels.narrow(dim, 1, labels.shape[dim] - 1), tail], dim=dim)


def shard_batch_for_cp(
    batch: Mapping[str, Any],
    cp_mesh: DeviceMesh,
    *,
    load_balanced: bool = False,
    seq_dim: int = 1,
    ignore_index: int = -100,
) -> dict[str, Any]:
    """This cp rank's part of ``batch`` (whole sequences, identical on every cp rank).

    Returns a new dict for ``model(**sharded)``: the keys in :data:`SEQUENCE_KEYS`
    sharded, ``shift_labels`` and ``num_items_in_batch`` derived from ``labels``,
    ``position_ids`` created if absent, ``attention_mask`` moved into the layout under
    ``"hp_cp"``; other keys pass through unchanged. ``cp_mesh`` is the 1-D cp mesh (or
    anything with ``size()`` and ``get_local_rank()``).
    """
    if not isinstance(batch, Mapping):
        raise CPBatchError(
            f"shard_batch_for_cp: batch is a {type(batch).__name__}.\n"
            "batch must be a mapping of model inputs.\n"
            "Fix: pass a dict such as {'input_ids': ..., 'labels': ..., 'attention_mask': ...}."
        )
    if CP_LAYOUT_KEY in batch:
        raise CPBatchError(
            f"shard_batch_for_cp: batch already has {CP_LAYOUT_KEY!r}: it is sharded already.\n"
            "A batch is sharded once; sharding a chunk again would lose tokens.\n"
            "Fix: shard the unsharded batch, once."
        )
    cp_size, rank = int(cp_mesh.size()), int(cp_mesh.get_local_rank())
    source = next(
        (k for k in ("input_ids", "inputs_embeds") if isinstance(batch.get(k), torch.Tensor)), None
    )
    if source is None:
        raise CPBatchError(
            f"shard_batch_for_cp: the batch has no input_ids or inputs_embeds tensor "
            f"(keys: {sorted(map(str, batch))}).\n"
            "The batch needs input_ids or inputs_embeds (a tensor) to know the sequence length.\n"
            "Fix: include input_ids (or inputs_embeds) in the batch."
        )
    ref = batch[source]
    seq_len = ref.shape[seq_dim]
    local_length(
        seq_len,
        cp_size,
        load_balanced=load_balanced,
        what=f"sequence (batch[{source!r}] dim {seq_dim})",
    )
    out: dict[str, Any] = {k: v for k, v in batch.items() if k != "attention_mask"}
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and "shift_labels" not in batch:
        out["shift_labels"] = _shift(labels, seq_dim, ignore_index)
    if "shift_labels" in out and "num_items_in_batch" not in batch:
        out["num_items_in_batch"] = (out["shift_labels"] != ignore_index).sum()
    if not isinstance(batch.get("position_ids"), torch.Tensor):
        out["position_ids"] = torch.arange(seq_len, device=ref.device).unsqueeze(0)
    for key in SEQUENCE_KEYS:
        value = out.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        dim = value.dim() - 1 if key == "position_ids" else seq_dim
        if value.dim() <= dim or value.shape[dim] != seq_len:
            raise CPBatchError(
                f"shard_batch_for_cp: batch[{key!r}] has shape {tuple(value.shape)}, but dim {dim} "
                f"should be the sequence ({seq_len} tokens, from batch[{source!r}]).\n"
                "Every sequence input of one batch covers the same tokens.\n"
                f"Fix: give batch[{key!r}] the sequence length {seq_len} in dim {dim} (pad or "
                "truncate it with the other inputs), or leave it out of the batch."
            )
        out[key] = shard_sequence(value, dim, rank, cp_size, load_balanced=load_balanced)
    mask = batch.get("attention_mask")
    if mask is not None:
        if (
            not isinstance(mask, torch.Tensor)
            or mask.dim() not in (2, 4)
            or mask.shape[-1] != seq_len
        ):
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise CPBatchError(
                f"shard_batch_for_cp: batch['attention_mask'] has shape {shape}.\n"
                f"attention_mask must be a padding mask [batch, {seq_len}] or a 4-D mask "
                f"[batch, heads, {seq_len}, {seq_len}] over the whole sequence.\n"
                "Fix: pass the mask of the whole, unsharded sequence (the tokenizer's "
                "attention_mask)."
            )
    out[CP_LAYOUT_KEY] = CPLayout(cp_size, rank, seq_len, load_balanced, mask)
    return out


def gather_sequence(
    x: torch.Tensor, cp_mesh: DeviceMesh, *, load_balanced: bool = False, seq_dim: int = 1
) -> torch.Tensor:
    """Every rank's chunk of ``x`` put back into the whole sequence, in natural order.

    For inspection and evaluation (e.g. logits): the result is detached, not differentiable.
    """
    group = cp_mesh.get_group()
    n = dist.get_world_size(group)
    with torch.no_grad():
        front = x.detach().movedim(seq_dim, 0).contiguous()
        out = front.new_empty((n * front.shape[0], *front.shape[1:]))
        dist.all_gather_single(out, front, group=group)
        return unshard_sequence(out.movedim(0, seq_dim), seq_dim, n, load_balanced=load_balanced)
