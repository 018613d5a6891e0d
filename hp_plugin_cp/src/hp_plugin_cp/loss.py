"""The loss and the gradients of a CP model, made equal to the single-device ones.

* Loss. With the batch from :func:`~hp_plugin_cp.shard_batch_for_cp`, each rank's
  ``model(**batch).loss`` is its *share*: the sum of its tokens' losses divided by the
  global token count. :func:`enable_cp_loss` makes ``.loss`` the global loss on every rank
  (one all-reduce of a scalar per step, identity backward).
* Gradients. CP never shards parameters, and every rank's gradient is the contribution of
  its tokens: the single-device gradient is their sum over cp. Let FSDP/DDP reduce over a
  mesh that includes cp (and sum, not average, over cp), or call
  :func:`reduce_cp_gradients` after ``backward()`` (one bucketed all-reduce).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from hp_plugin_cp.collectives import all_reduce_sum
from hp_plugin_cp.errors import CPBatchError
from hp_plugin_cp.layout import CP_LAYOUT_KEY

__all__ = ["CPCausalLMLoss", "enable_cp_loss", "reduce_cp_gradients", "reduce_loss_over_cp"]


def reduce_loss_over_cp(loss: torch.Tensor, cp_mesh: Any) -> torch.Tensor:
    """Sum each rank's loss share over cp (differentiable; backward is the identity)."""
    return all_reduce_sum(loss, cp_mesh.get_group())


class CPCausalLMLoss:
    """Wraps a model's causal-LM ``loss_function`` so that it returns the global loss.

    Needs ``shift_labels`` (labels shifted before sharding; per-chunk shifting would drop
    the label at every chunk edge). With ``num_items_in_batch`` (the global count, as the
    batch helper sets it) the local sum is divided by it and summed over cp; without it,
    the local sum and count are summed over cp together (still one all-reduce).
    """

    def __init__(self, base: Any, group: Any) -> None:
        self.base = base
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
        kwargs.pop(CP_LAYOUT_KEY, None)
        if shift_labels is None:
            raise CPBatchError(
                "CP loss: labels must be shifted before the sequence is sharded (shift_labels), or the token "
                "at every chunk edge loses its label. Build the batch with shard_batch_for_cp(batch, cp_mesh)."
            )
        if num_items_in_batch is not None:
            share = self.base(logits, labels, vocab_size=vocab_size, num_items_in_batch=num_items_in_batch,
                              ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
            return all_reduce_sum(share, self.group)
        total = self.base(logits, labels, vocab_size=vocab_size, num_items_in_batch=1,
                          ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        count = (shift_labels != ignore_index).sum().to(total.dtype)
        both = all_reduce_sum(torch.stack([total, count]), self.group)
        return both[0] / both[1]


def enable_cp_loss(model: nn.Module, cp_mesh: Any) -> nn.Module:
    """Make ``model(**sharded_batch).loss`` the global (single-device) loss on every cp rank.

    Wraps ``model.loss_function`` (HF causal LMs); call it after ``hp_core.apply`` so it
    wraps a vocab-parallel loss too. Idempotent. Returns the model.
    """
    if not hasattr(type(model), "loss_function"):
        raise CPBatchError(
            f"enable_cp_loss: {type(model).__name__} computes no loss through 'loss_function' (HF causal LMs "
            "do); reduce your own loss with reduce_loss_over_cp(loss, cp_mesh)."
        )
    current = model.loss_function
    if not isinstance(current, CPCausalLMLoss):
        model.loss_function = CPCausalLMLoss(current, cp_mesh.get_group())
    return model


def reduce_cp_gradients(model: nn.Module, cp_mesh: Any) -> int:
    """Sum every parameter gradient over cp in one bucketed all-reduce; returns how many.

    Call it once per optimizer step, after the last ``backward()`` (with gradient
    accumulation, after the last micro-batch: calling it twice sums twice), and only when
    no FSDP/DDP reduces over cp for you. Every cp rank must hold gradients for the same
    parameters (they run the same model, so they do). In
    validate mode a gradient DTensor may say ``Partial`` on cp (DTensor propagation knows
    it is a share) or ``Replicate`` (a local region cannot tell); both are shares, and
    both come out summed and ``Replicate`` on cp.
    """
    cp_name = (cp_mesh.mesh_dim_names or ("cp",))[0]
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0
    with torch.no_grad():  # DTensor.to_local() then returns the local tensor itself
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=cp_mesh.get_group())
        offset = 0
        for p, g in zip(params, grads, strict=True):
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
            if isinstance(p.grad, DTensor):
                names = list(p.grad.device_mesh.mesh_dim_names or ())
                placements = list(p.grad.placements)
                if cp_name in names and isinstance(placements[names.index(cp_name)], Partial):
                    placements[names.index(cp_name)] = Replicate()
                    p.grad = DTensor.from_local(g, p.grad.device_mesh, placements, run_check=False)
    return len(params)
