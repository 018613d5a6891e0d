"""Context-parallel attention on local tensors: gather K/V, mask by global position, attend.

Inputs use the SDPA layout ``[batch, heads, local_len, head_dim]``. The local queries
attend to the keys of the whole sequence: K and V are all-gathered over the cp group in
one collective, GQA K/V heads are expanded after the gather (identically on every rank),
and the causal/user mask is built from global positions (see :mod:`hp_plugin_cp.layout`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from hp_plugin_cp.collectives import all_gather_kv
from hp_plugin_cp.errors import CPBatchError, CPMaskError, CPUnsupportedError
from hp_plugin_cp.layout import CPLayout, narrow_mask

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["cp_flex_attention", "cp_sdpa", "expand_kv_heads"]


def expand_kv_heads(x: torch.Tensor, q_heads: int, *, where: str) -> torch.Tensor:
    """Repeat each K/V head ``q_heads / kv_heads`` times in place (HF ``repeat_kv`` order)."""
    kv_heads = x.shape[-3]
    if kv_heads == q_heads:
        return x
    if q_heads % kv_heads:
        raise CPBatchError(
            f"{where}: {q_heads} query heads are not a multiple of {kv_heads} key/value heads.\n"
            "Grouped-query attention repeats each key/value head for a whole group of queries.\n"
            "Fix: pass the q, k and v of one attention call, unchanged."
        )
    rep = q_heads // kv_heads
    b, _, s, d = x.shape
    return x[:, :, None].expand(b, kv_heads, rep, s, d).reshape(b, q_heads, s, d)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CPLayout, where: str) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise CPBatchError(
            f"{where}: q, k, v have shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.\n"
            "CP attention takes q, k, v in the SDPA layout [batch, heads, seq, head_dim].\n"
            "Fix: transpose them to [batch, heads, seq, head_dim] before the attention call, as "
            "torch's scaled_dot_product_attention takes them."
        )
    if k.shape[-2] != q.shape[-2] or v.shape[-2] != q.shape[-2]:
        raise CPUnsupportedError(
            f"{where}: {q.shape[-2]} queries but {k.shape[-2]} keys.\n"
            "Queries and keys must cover the same local chunk: CP attention is for training and "
            "prefill without a KV cache.\n"
            "Fix: call the model with use_cache=False."
        )
    if q.shape[-2] != layout.local_len:
        raise CPBatchError(
            f"{where}: the attention sees {q.shape[-2]} local positions but the batch was sharded "
            f"into chunks of {layout.local_len} ({layout.seq_len} tokens over "
            f"cp={layout.cp_size}).\n"
            "Every sequence input must be sharded into the same chunks.\n"
            "Fix: shard every sequence input with the same shard_batch_for_cp call."
        )


def _gather(
    k: torch.Tensor, v: torch.Tensor, group: ProcessGroup, layout: CPLayout, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = all_gather_kv(k, v, group, seq_dim=-2)
    visible = layout.visible_keys(causal)
    if visible < layout.seq_len:  # later ranks' chunks are entirely in this rank's future
        k, v = k[..., :visible, :], v[..., :visible, :]
    return k, v


def cp_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group: ProcessGroup,
    layout: CPLayout,
    causal: bool,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    where: str,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` of the local queries over the gathered keys.

    ``attn_mask`` (optional) is global (see :func:`hp_plugin_cp.layout.narrow_mask`); without
    it the layout's own mask (the batch's padding) applies.
    """
    _check(query, key, value, layout, where)
    key, value = _gather(key, value, group, layout, causal)
    mask = layout.mask(causal, query.device, attn_mask, where=where)
    if mask is not None and mask.is_floating_point() and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)  # an additive mask must match the queries' dtype
    key = expand_kv_heads(key, query.shape[-3], where=where)
    value = expand_kv_heads(value, query.shape[-3], where=where)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale
    )


def _global_score_mod(
    score_mod: Callable[..., Any], q_pos: torch.Tensor, k_pos: torch.Tensor
) -> Callable[..., Any]:
    def mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score_mod(score, b, h, q_pos[q_idx], k_pos[kv_idx])

    return mod


def _block_mask(
    layout: CPLayout, causal: bool, query: torch.Tensor, visible: int, where: str
) -> Any:
    """A flex ``BlockMask`` equal to :meth:`CPLayout.mask` (None when nothing is hidden)."""
    from torch.nn.attention.flex_attention import create_block_mask

    device = query.device
    q_pos = layout.query_positions(device)
    k_pos = layout.key_positions(device)[:visible]
    user = layout.attention_mask
    pad = None
    if user is not None:
        if user.dim() != 2:
            raise CPUnsupportedError(
                f"{where}: the batch's attention mask has shape {tuple(user.shape)}.\n"
                "Flex CP attention takes a 2-D padding mask [batch, seq] only.\n"
                "Fix: use the sdpa wrappers (sdpa_hf / sdpa_qkv) for other masks."
            )
        pad = narrow_mask(user.to(device), q_pos, k_pos, layout.seq_len, where=where)[:, 0, 0, :]
    if not causal and pad is None:
        return None

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        ok = k_pos[kv_idx] <= q_pos[q_idx] if causal else q_idx >= 0
        return ok & pad[b, kv_idx] if pad is not None else ok

    batch = pad.shape[0] if pad is not None else None
    key = ("block_mask", causal, str(device), batch)
    return layout._cached(
        key,
        lambda: create_block_mask(mask_mod, batch, None, query.shape[-2], visible, device=device),
    )


def cp_flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group: ProcessGroup,
    layout: CPLayout,
    causal: bool,
    score_mod: Callable[..., Any] | None = None,
    scale: float | None = None,
    kernel_options: Any = None,
    returns: dict[str, Any] | None = None,
    where: str,
) -> Any:
    """``flex_attention`` of the local queries over the gathered keys.

    The block mask is built from global positions (causal) and the layout's padding mask;
    ``score_mod`` sees *global* query/key positions. ``returns`` passes ``return_lse`` /
    ``return_aux`` through, so the result has the shape the caller asked for.
    """
    from torch.nn.attention.flex_attention import flex_attention

    _check(query, key, value, layout, where)
    key, value = _gather(key, value, group, layout, causal)
    visible = key.shape[-2]
    block_mask = _block_mask(layout, causal, query, visible, where)
    key = expand_kv_heads(key, query.shape[-3], where=where)
    value = expand_kv_heads(value, query.shape[-3], where=where)
    if score_mod is not None:
        score_mod = _global_score_mod(
            score_mod,
            layout.query_positions(query.device),
            layout.key_positions(query.device)[:visible],
        )
    try:
        return flex_attention(
            query,
            key,
            value,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=scale,
            kernel_options=kernel_options,
            **(returns or {}),
        )
    except NotImplementedError as e:
        raise CPUnsupportedError(
            f"{where}: torch {torch.__version__} cannot run flex attention here: {e}\n"
            "On CPU, flex attention is forward-only.\n"
            "Fix: run it under torch.no_grad() (evaluation), or train with the sdpa_hf / "
            "sdpa_qkv wrappers, or on a GPU."
        ) from e


def user_mask_error(where: str, shape: tuple[int, ...]) -> CPMaskError:
    """The error for a mask computed inside a wrapped module from its local chunk."""
    return CPMaskError(
        f"{where}: the attention call carried a mask of shape {shape} computed from the local "
        "chunk.\n"
        "A mask of the local chunk cannot describe the other ranks' keys.\n"
        "Fix: pass the global mask through the batch (shard_batch_for_cp(..., attention_mask)) "
        "instead."
    )
