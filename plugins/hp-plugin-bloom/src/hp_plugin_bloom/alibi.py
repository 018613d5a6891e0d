"""The inner wrapper of ``BloomAttention``: each tp rank attends with its own heads' ALiBi rows.

``BloomModel`` builds the ALiBi bias of *all* heads once, shaped ``(batch * heads, 1,
kv)`` with the heads flattened batch-major into dim 0, and hands the same tensor to
every layer's attention. Under tensor parallelism a rank holds a contiguous block of
heads (``query_key_value`` is packed per head, so a contiguous row shard is whole
heads), and its ``baddbmm`` needs exactly those heads' rows of the bias: rows
``b * heads + h`` for its ``h``, a strided selection that no placement of the
boundary's input can express (a ``Shard(0)`` of it would hand a rank whole batch
elements instead). This wrapper makes it: it views the bias as ``(batch, heads, 1,
kv)``, keeps this rank's heads, flattens back, and runs the module's own forward with
its head count set to the local one for the call — and, like every BLOOM block, with
the residual added to the partial sum once (:mod:`hp_plugin_bloom.local_region`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Partial, Shard

from hp_core import ParallelContext, inner_wrapper
from hp_plugin_bloom.local_region import BloomTensorParallelError, LocalRegion, tp_position

__all__ = ["ALIBI_WRAPPER", "HeadSlicedAttention", "bloom_alibi_heads", "local_heads"]

#: The registry name of :func:`bloom_alibi_heads`.
ALIBI_WRAPPER = "bloom_alibi_heads"


def _qkv_shape(module: nn.Module) -> tuple[int, ...]:
    weight: Any = getattr(module.get_submodule("query_key_value"), "weight")  # noqa: B009
    return tuple(int(n) for n in weight.shape)


def local_heads(module: nn.Module) -> int:
    """This rank's head count: its ``query_key_value`` rows over ``3 * head_dim``."""
    return _qkv_shape(module)[0] // (3 * int(getattr(module, "head_dim")))  # noqa: B009


class HeadSlicedAttention(LocalRegion):
    """``BloomAttention.forward`` with this rank's ALiBi rows and head count."""

    #: The attention output is a partial sum; the attention probabilities are per head.
    output_placements = (Partial(), Shard(1))

    def local_arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        arguments = super().local_arguments(arguments)
        hidden, alibi = arguments["hidden_states"], arguments["alibi"]
        heads = local_heads(self.module)
        batch = int(hidden.shape[0])
        total = int(alibi.shape[0]) // batch
        if total == heads:  # every head is here (tp=1, or the attention kept whole)
            return arguments
        if total != heads * self.size or int(alibi.shape[0]) != batch * total:
            raise BloomTensorParallelError(
                f"{self.fqn}: its ALiBi bias has shape {tuple(alibi.shape)} for a batch of "
                f"{batch}, but this rank holds {heads} heads over tp={self.size} "
                f"(query_key_value shard {_qkv_shape(self.module)}), so "
                "the bias rows cannot be split into this rank's heads. Fix: shard "
                "query_key_value Shard(0) with whole heads per rank (a tp size that divides "
                "n_head), or keep the attention whole on tp."
            )
        return {**arguments, "alibi": self._rows(alibi, batch, total, heads)}

    def _rows(self, alibi: torch.Tensor, batch: int, total: int, heads: int) -> torch.Tensor:
        """Rows ``b * total + h`` for this rank's heads ``h``, batch-major like the original."""
        start = self.rank * heads
        mine = alibi.view(batch, total, *alibi.shape[1:])[:, start : start + heads]
        return mine.reshape(batch * heads, *alibi.shape[1:])

    def run(self, arguments: dict[str, Any]) -> Any:
        module: Any = self.module
        before = module.num_heads
        module.num_heads = local_heads(module)  # production has it local already; validate not
        try:
            return super().run(arguments)
        finally:
            module.num_heads = before


@inner_wrapper
def bloom_alibi_heads(target_module: nn.Module, ctx: ParallelContext) -> Any:
    """Run ``BloomAttention`` with this tp rank's heads' rows of the shared ALiBi bias."""
    return HeadSlicedAttention(target_module, *tp_position(target_module, ctx))
