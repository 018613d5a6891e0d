"""Vocabulary-parallel pieces: the masked embedding lookup and the cross-entropy loss.

With the vocabulary sharded over tp, each rank holds rows ``[start, end)`` of the
embedding / lm_head weight. The lookup zeroes ids outside the shard (the exit
all-reduce sums the partial rows); the loss works on the local logit slice with three
small all-reduces (max, sum of exponentials, target logit) and no gathered logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["VocabParallelCausalLMLoss", "vocab_parallel_cross_entropy", "vocab_parallel_embedding"]


def vocab_parallel_embedding(module: nn.Embedding, group: Any) -> Any:
    """Production forward of an ``nn.Embedding`` whose weight is this rank's vocabulary rows."""
    rank = dist.get_rank(group)

    def forward(input: torch.Tensor) -> torch.Tensor:
        rows = module.weight.shape[0]
        start = rank * rows
        outside = (input < start) | (input >= start + rows)
        local_ids = (input - start).masked_fill(outside, 0)
        pad = module.padding_idx
        local_pad = pad - start if pad is not None and start <= pad < start + rows else None
        out = F.embedding(local_ids, module.weight, local_pad, module.max_norm, module.norm_type, module.scale_grad_by_freq, module.sparse)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    return forward


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, group: Any) -> torch.Tensor:
        vocab_local = logits.shape[-1]
        start = dist.get_rank(group) * vocab_local
        logits = logits.float()
        gmax = logits.max(dim=-1).values
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - gmax.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        valid = target != ignore_index
        in_shard = valid & (target >= start) & (target < start + vocab_local)
        local_t = (target - start).masked_fill(~in_shard, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~in_shard, 0.0)
        both = torch.stack([sum_exp, picked])
        dist.all_reduce(both, group=group)
        sum_exp, picked = both[0], both[1]
        loss = (sum_exp.log() - picked).masked_fill(~valid, 0.0)
        ctx.save_for_backward(exp, sum_exp, local_t, in_shard, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        exp, sum_exp, local_t, in_shard, valid = ctx.saved_tensors
        grad = exp / sum_exp.unsqueeze(-1)
        onehot = torch.zeros_like(grad).scatter_(-1, local_t.unsqueeze(-1), 1.0) * in_shard.unsqueeze(-1)
        grad = (grad - onehot) * (g * valid).unsqueeze(-1)
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Any, *, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy from this rank's slice of the vocabulary (0 where ignored)."""
    return _VocabParallelCE.apply(logits, target, ignore_index, group)


class VocabParallelCausalLMLoss:
    """Drop-in for transformers' ``ForCausalLMLoss`` on vocab-sharded logits.

    Same semantics: labels are padded and shifted left by one unless ``shift_labels`` is
    given; the mean is over non-ignored tokens, or a sum divided by
    ``num_items_in_batch`` when that is passed.
    """

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None = None,
        vocab_size: int | None = None,
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            padded = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = padded[..., 1:].contiguous()
        per_token = vocab_parallel_cross_entropy(
            logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1).to(logits.device), self.group, ignore_index=ignore_index
        )
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(per_token.device)
            return per_token.sum() / num_items_in_batch
        count = (shift_labels != ignore_index).sum()
        return per_token.sum() / count
