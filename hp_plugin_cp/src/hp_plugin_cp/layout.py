"""How a sequence is laid out over the cp ranks, and the masks that follow from it.

Two layouts, both cutting the global sequence of length ``S`` into equal chunks:

* contiguous (default): rank ``r`` holds chunk ``r`` of ``cp`` chunks, i.e. global
  positions ``[r * L, (r + 1) * L)`` with ``L = S / cp``;
* load-balanced: the sequence is cut into ``2 * cp`` chunks and rank ``r`` holds chunk
  ``r`` followed by chunk ``2 * cp - 1 - r``. Under a causal mask every rank then does the
  same amount of work (the contiguous layout leaves rank ``cp - 1`` with the most).

The K/V all-gather concatenates the ranks' local chunks in rank order, so gathered key
``j`` sits at global position ``key_positions()[j]``. Masks are built from global
positions: local query row ``i`` may see gathered key ``j`` iff
``key_positions[j] <= query_positions[i]`` (for the contiguous layout:
``j <= r * L + i``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hp_plugin_cp.errors import CPBatchError, CPMaskError

__all__ = [
    "CP_LAYOUT_KEY",
    "CPLayout",
    "chunk_positions",
    "gathered_positions",
    "local_length",
    "narrow_mask",
    "shard_sequence",
    "unshard_sequence",
]

#: The batch key (and model keyword argument) that carries a :class:`CPLayout` from
#: :func:`hp_plugin_cp.shard_batch_for_cp` down to the attention wrappers and the loss.
CP_LAYOUT_KEY = "hp_cp"


def local_length(seq_len: int, cp_size: int, *, load_balanced: bool, what: str = "sequence") -> int:
    """``seq_len / cp_size``, or a :class:`CPBatchError` that says how to pad."""
    chunks = 2 * cp_size if load_balanced else cp_size
    if seq_len <= 0 or seq_len % chunks:
        scheme = (
            f"load-balanced sharding cuts it into 2 * cp = {chunks} chunks"
            if load_balanced
            else f"cp = {cp_size} ranks each hold one chunk"
        )
        fix = -(-max(seq_len, 1) // chunks) * chunks
        raise CPBatchError(
            f"{what}: length {seq_len} is not divisible by {chunks}.\n"
            f"The sequence must split evenly: {scheme}.\n"
            f"Fix: pad the batch to a multiple of {chunks} (e.g. to {fix}: a tokenizer/collator "
            f"with pad_to_multiple_of={chunks}) and mark the padding with attention_mask = 0 and "
            "labels = -100."
        )
    return seq_len // cp_size


def chunk_positions(
    rank: int,
    cp_size: int,
    local_len: int,
    *,
    load_balanced: bool,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global positions of the ``local_len`` tokens rank ``rank`` holds, in local order."""
    if not load_balanced:
        return torch.arange(rank * local_len, (rank + 1) * local_len, device=device)
    if local_len % 2:
        raise CPBatchError(
            f"chunk_positions: local length {local_len} is odd.\n"
            "Load-balanced CP needs an even local length (two half chunks per rank).\n"
            f"Fix: pad the sequence to a multiple of 2 * cp = {2 * cp_size}."
        )
    half = local_len // 2
    tail = 2 * cp_size - 1 - rank
    return torch.cat(
        [
            torch.arange(rank * half, (rank + 1) * half, device=device),
            torch.arange(tail * half, (tail + 1) * half, device=device),
        ]
    )


def gathered_positions(
    cp_size: int, local_len: int, *, load_balanced: bool, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions of the keys after the all-gather (the ranks' chunks in rank order)."""
    return torch.cat(
        [
            chunk_positions(r, cp_size, local_len, load_balanced=load_balanced, device=device)
            for r in range(cp_size)
        ]
    )


def shard_sequence(
    x: torch.Tensor, dim: int, rank: int, cp_size: int, *, load_balanced: bool
) -> torch.Tensor:
    """The part of ``x`` (whole sequence along ``dim``) that rank ``rank`` holds."""
    seq_len = x.shape[dim]
    local = local_length(seq_len, cp_size, load_balanced=load_balanced)
    index = chunk_positions(rank, cp_size, local, load_balanced=load_balanced, device=x.device)
    if not load_balanced:
        return x.narrow(dim, rank * local, local).contiguous()
    return x.index_select(dim, index)


def unshard_sequence(
    gathered: torch.Tensor, dim: int, cp_size: int, *, load_balanced: bool
) -> torch.Tensor:
    """Undo the layout: ranks' chunks concatenated in rank order → natural sequence order."""
    if not load_balanced:
        return gathered
    local = gathered.shape[dim] // cp_size
    order = torch.argsort(
        gathered_positions(cp_size, local, load_balanced=True, device=gathered.device)
    )
    return gathered.index_select(dim, order)


def narrow_mask(
    mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, seq_len: int, *, where: str
) -> torch.Tensor:
    """A global mask → this rank's rows (queries at ``q_pos``) against the gathered keys ``k_pos``.

    Accepted: a 2-D padding mask ``[B, S]`` (nonzero = a real token) → ``[B, 1, 1, S']``;
    a 4-D mask ``[B|1, H|1, S|L|1, S]`` (bool/int: nonzero = may attend; float: additive).
    The key dimension must be global (``S``): a mask of the local chunk cannot say which of
    the other ranks' keys to hide.
    """
    local_len = q_pos.numel()
    if mask.dim() == 2:
        if mask.shape[-1] != seq_len:
            raise CPMaskError(
                f"{where}: the 2-D padding mask has shape {tuple(mask.shape)}.\n"
                f"A 2-D padding mask must cover the whole sequence ({seq_len} tokens).\n"
                "Fix: pass the unsharded attention_mask to shard_batch_for_cp."
            )
        return (mask != 0).index_select(-1, k_pos.to(mask.device))[:, None, None, :]
    if (
        mask.dim() != 4
        or mask.shape[-1] != seq_len
        or mask.shape[-2] not in (1, local_len, seq_len)
    ):
        raise CPMaskError(
            f"{where}: the attention mask has shape {tuple(mask.shape)}.\n"
            f"Expected a padding mask [batch, {seq_len}] or a 4-D mask [batch, heads, {seq_len} "
            f"(or {local_len} local rows), {seq_len}] over the global keys: a mask built from the "
            "local chunk cannot hide the other ranks' keys.\n"
            "Fix: pass the mask of the whole sequence to shard_batch_for_cp(batch, cp_mesh)."
        )
    if mask.shape[-2] == seq_len and seq_len != local_len:
        mask = mask.index_select(-2, q_pos.to(mask.device))
    mask = mask.index_select(-1, k_pos.to(mask.device))
    return mask if mask.is_floating_point() else mask != 0


def combine_masks(user: torch.Tensor | None, causal: torch.Tensor | None) -> torch.Tensor | None:
    """``user AND causal`` for boolean masks; an additive float mask gets ``-inf`` where causal
    hides."""
    if user is None:
        return causal
    if causal is None:
        return user
    if user.is_floating_point():
        return user.masked_fill(~causal, float("-inf"))
    return user & causal


@dataclasses.dataclass(eq=False)
class CPLayout:
    """How one batch is sharded over cp; made by :func:`hp_plugin_cp.shard_batch_for_cp`.

    It travels with the batch (key :data:`CP_LAYOUT_KEY`) to every CP attention wrapper,
    carrying the *global* attention mask, which the model-level code never sees (it only
    holds the local chunk). Masks are cached per layout, so all layers share one.
    """

    cp_size: int
    cp_rank: int
    seq_len: int
    load_balanced: bool = False
    attention_mask: torch.Tensor | None = None
    _cache: dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.cp_rank < self.cp_size:
            raise CPBatchError(
                f"CPLayout: cp_rank {self.cp_rank} is outside [0, {self.cp_size}).\n"
                "A rank's index on the cp axis is below the axis size.\n"
                "Fix: build the layout with shard_batch_for_cp(batch, cp_mesh), which takes the "
                "rank from the mesh."
            )
        local_length(self.seq_len, self.cp_size, load_balanced=self.load_balanced)

    @property
    def local_len(self) -> int:
        return self.seq_len // self.cp_size

    def query_positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of this rank's tokens (its local query rows)."""
        return self._cached(
            ("q", str(device)),
            lambda: chunk_positions(
                self.cp_rank,
                self.cp_size,
                self.local_len,
                load_balanced=self.load_balanced,
                device=device,
            ),
        )

    def key_positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of the gathered keys, in gather (rank) order."""
        return self._cached(
            ("k", str(device)),
            lambda: gathered_positions(
                self.cp_size, self.local_len, load_balanced=self.load_balanced, device=device
            ),
        )

    def visible_keys(self, causal: bool) -> int:
        """How many gathered keys any local query can see: a causal contiguous layout drops
        the later ranks' chunks (every one of their keys is in the future)."""
        if causal and not self.load_balanced:
            return (self.cp_rank + 1) * self.local_len
        return self.seq_len

    def mask(
        self,
        causal: bool,
        device: torch.device,
        user_mask: torch.Tensor | None = None,
        *,
        where: str,
    ) -> torch.Tensor | None:
        """The local ``[B|1, H|1, L, K]`` mask: causal by global position AND the user mask.

        ``K = visible_keys(causal)``. ``user_mask`` defaults to the layout's own
        ``attention_mask``; an explicit one is not cached.
        """
        cacheable = user_mask is None
        user = self.attention_mask if user_mask is None else user_mask

        def build() -> torch.Tensor | None:
            visible = self.visible_keys(causal)
            q_pos = self.query_positions(device)
            k_pos = self.key_positions(device)[:visible]
            causal_mask = (k_pos[None, :] <= q_pos[:, None])[None, None] if causal else None
            narrowed = (
                narrow_mask(user.to(device), q_pos, k_pos, self.seq_len, where=where)
                if user is not None
                else None
            )
            return combine_masks(narrowed, causal_mask)

        if not cacheable:
            return build()
        return self._cached(("mask", causal, str(device)), build)

    def _cached(self, key: Any, make: Any) -> Any:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]
