"""CP's collectives: the packed K/V all-gather, and what each attention call declares.

K and V travel together: they are packed into one tensor along the feature dim, so each
attention call costs exactly one all-gather forward and one reduce-scatter backward
(every rank's queries contribute to every rank's keys, so the gradient of a gathered key
is the sum over ranks). The collective itself is the core's
:func:`hp_core.collectives.all_gather_along`; :func:`cp_attention_collectives` declares
it to hp's prediction (``explain()``, ``hp plan``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from hp_core.collectives import Collective, all_gather_along
from hp_plugin_cp.errors import CPBatchError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["all_gather_kv", "cp_attention_collectives"]


def all_gather_kv(
    key: torch.Tensor, value: torch.Tensor, group: ProcessGroup, *, seq_dim: int = -2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather K and V along the sequence dim in **one** collective (packed along the last dim).

    ``key`` ``[..., L, Dk]`` and ``value`` ``[..., L, Dv]`` must agree on every dim but the
    last. Returns ``[..., cp * L, Dk]`` and ``[..., cp * L, Dv]`` in rank order.
    """
    if key.shape[:-1] != value.shape[:-1]:
        raise CPBatchError(
            f"all_gather_kv: key {tuple(key.shape)} and value {tuple(value.shape)} differ in a dim "
            "other than the last.\n"
            "Key and value must agree on batch, heads and sequence to travel in one packed "
            "collective.\n"
            "Fix: pass the key and value of one attention call, both in the SDPA layout "
            "[batch, heads, seq, head_dim]."
        )
    packed = torch.cat([key, value], dim=-1)
    gathered = all_gather_along(packed, seq_dim % packed.dim(), group, grad_partial=True)
    k, v = gathered.split([key.shape[-1], value.shape[-1]], dim=-1)
    return k, v


def cp_attention_collectives(
    sizes: Mapping[str, int], config: Mapping[str, Any]
) -> list[Collective]:
    """The collectives of one CP attention call: the K/V gather and its reduce-scatter."""
    if int(sizes.get("cp", 1)) <= 1:
        return []
    where = "cp attention K/V"
    return [
        Collective("all_gather", "cp", "forward", where),
        Collective("reduce_scatter", "cp", "backward", where),
    ]
