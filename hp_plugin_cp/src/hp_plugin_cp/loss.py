"""The loss and the gradients of a CP model, made equal to the single-device ones.

* Loss. With the batch from :func:`~hp_plugin_cp.shard_batch_for_cp`, each rank's
  ``model(**batch).loss`` is its *share*: the sum of its tokens' losses divided by the
  global token count. :func:`enable_cp_loss` makes ``.loss`` the global loss on every rank
  (one all-reduce of a scalar per step, identity backward).
* Gradients. CP never shards parameters, and every rank's gradient is the contribution of
  its tokens: the single-device gradient is their sum over cp. ``hp_core.apply`` derives
  that and sums them over cp itself after every backward (one bucketed all-reduce per
  step); :func:`reduce_cp_gradients` is a no-op kept for old training loops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hp_core.collectives import all_reduce
from hp_plugin_cp.errors import CPBatchError
from hp_plugin_cp.layout import CP_LAYOUT_KEY

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["CPCausalLMLoss", "enable_cp_loss", "reduce_cp_gradients", "reduce_loss_over_cp"]


def reduce_loss_over_cp(loss: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """Sum each rank's loss share over cp (differentiable; backward is the identity)."""
    return all_reduce(loss, cp_mesh.get_group())


class CPCausalLMLoss:
    """Wraps a model's causal-LM ``loss_function`` so that it returns the global loss.

    Needs ``shift_labels`` (labels shifted before sharding; per-chunk shifting would drop
    the label at every chunk edge). With ``num_items_in_batch`` (the global count, as the
    batch helper sets it) the local sum is divided by it and summed over cp; without it,
    the local sum and count are summed over cp together (still one all-reduce).
    """

    def __init__(self, base: Any, group: ProcessGroup) -> None:
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
                "CP loss (model.loss_function): the call got no shift_labels.\n"
                "Labels must be shifted before the sequence is sharded, or the token at every "
                "chunk edge loses its label.\n"
                "Fix: build the batch with shard_batch_for_cp(batch, cp_mesh)."
            )
        if num_items_in_batch is not None:
            share = self.base(
                logits,
                labels,
                vocab_size=vocab_size,
                num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index,
                shift_labels=shift_labels,
                **kwargs,
            )
            return all_reduce(share, self.group)
        total = self.base(
            logits,
            labels,
            vocab_size=vocab_size,
            num_items_in_batch=1,
            ignore_index=ignore_index,
            shift_labels=shift_labels,
            **kwargs,
        )
        count = (shift_labels != ignore_index).sum().to(total.dtype)
        both = all_reduce(torch.stack([total, count]), self.group)
        return both[0] / both[1]


def enable_cp_loss(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Make ``model(**sharded_batch).loss`` the global (single-device) loss on every cp rank.

    Wraps ``model.loss_function`` (HF causal LMs); call it after ``hp_core.apply`` so it
    wraps a vocab-parallel loss too. Idempotent. Returns the model.
    """
    if not hasattr(type(model), "loss_function"):
        raise CPBatchError(
            f"enable_cp_loss: {type(model).__name__} computes no loss through 'loss_function'.\n"
            "enable_cp_loss wraps an HF causal LM's loss_function.\n"
            "Fix: reduce your own loss with reduce_loss_over_cp(loss, cp_mesh)."
        )
    current = model.loss_function
    if not isinstance(current, CPCausalLMLoss):
        # nn.Module.__setattr__ is typed for tensors and modules; HF reads a plain callable here.
        model.loss_function = CPCausalLMLoss(current, cp_mesh.get_group())  # type: ignore[assignment]
    return model


def reduce_cp_gradients(model: nn.Module, cp_mesh: DeviceMesh | None) -> int:
    """A no-op, kept so that existing training loops keep working; returns 0.

    ``hp_core.apply`` derives which gradients are partial over cp (every parameter sees only
    this rank's tokens) and sums them itself at the end of every backward, after FSDP/DDP.
    Calling this as well used to sum them twice; now it does nothing.
    """
    del model, cp_mesh
    return 0
