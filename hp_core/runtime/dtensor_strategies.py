"""Sharding strategies DTensor lacks for the attention kernel validate mode runs on CPU.

On CPU, ``F.scaled_dot_product_attention`` without dropout dispatches to
``aten._scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``). torch 2.13
registers DTensor strategies for the CUDA flash, efficient and cuDNN kernels, not for these
two, so a region whose attention sees DTensors fails with "does not have a sharding strategy
registered". :func:`register_missing_strategies` registers, through torch's
``register_sharding``, the placements under which the kernel computes exactly what it
computes on one device:

* everything replicated;
* heads sharded: ``Shard(1)`` on q, k, v, the output, the logsumexp (``[B, H, L]`` on CPU)
  and, in backward, the output gradient and the three input gradients;
* batch sharded: ``Shard(0)`` on all of them.

Grouped-query attention reaches the kernel with fewer k/v heads than q heads (the kernel maps
q head ``i`` to k/v head ``i // (Hq / Hkv)``). Contiguous head shards keep that map only when
every rank holds whole groups, so heads are offered then only if the k/v heads divide evenly
over the whole mesh.

The ``attn_mask`` keyword is the delicate part: DTensor redistributes positional arguments
to the chosen strategy but never keyword arguments, so a strategy that wants the mask in
another placement than it has would hand the kernel the wrong local mask. Only strategies
that keep the mask exactly where it is are offered: ``Replicate`` where the mask broadcasts
over the sharded dimension (size 1 or absent), the same ``Shard`` where it has that
dimension in full. ``register_sharding`` also leaves keyword tensors out of DTensor's
sharding-cache key, so two calls that differ only in their mask would share one decision;
the mask is added to that key here.

Dropout needs no case: the CPU flash kernel refuses ``dropout_p > 0``, and
``scaled_dot_product_attention`` then takes the math path, whose ops DTensor has.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding
from torch.nn.attention import SDPBackend, sdpa_kernel

from hp_core.errors import HpError

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = [
    "FLASH_CPU",
    "FLASH_CPU_BACKWARD",
    "AttentionMaskPlacementError",
    "has_strategy",
    "register_missing_strategies",
    "validate_attention_kernels",
]

_aten = torch.ops.aten
FLASH_CPU: OpOverload = _aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_CPU_BACKWARD: OpOverload = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default

#: (outputs, inputs) placements of one candidate on one mesh dimension, as register_sharding
#: wants them.
_Candidate = tuple[list[Placement | None], list[Placement | None]]


class AttentionMaskPlacementError(HpError, NotImplementedError):
    """An ``attn_mask`` DTensor placed where no exact strategy of the CPU kernel keeps it."""


def _propagator() -> Any:
    return DTensor._op_dispatcher.sharding_propagator


def has_strategy(op: OpOverload) -> bool:
    """Whether DTensor already has a registered strategy or rule for ``op``.

    Only explicit registrations count. torch also tries a decomposition for ops that have one
    (the CPU flash forward has), but in 2.13 that yields no strategy for this op."""
    prop = _propagator()
    registries = ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules")
    return any(op in getattr(prop, name, {}) for name in registries)


def _mask_placement(mask: DTensorSpec, dim_from_end: int) -> Placement:
    """Where the mask must be for a strategy sharding q's dimension ``4 - dim_from_end``:
    replicated when it broadcasts over that dimension, else sharded on its own copy of it."""
    dim = mask.ndim - dim_from_end
    if dim < 0 or mask.shape[dim] == 1:
        return Replicate()
    return Shard(dim)


def _mask_where(mask: DTensorSpec, op: OpOverload) -> Placement:
    """The mask's one placement on every mesh dimension, which every candidate must keep."""
    placements = set(mask.placements)
    if len(placements) != 1:
        raise AttentionMaskPlacementError(
            f"{op}: attn_mask is a DTensor placed {tuple(mask.placements)}, different on the "
            "mesh's dimensions; DTensor does not redistribute keyword arguments, so hp's "
            "strategies for this kernel take the mask only where it is the same on every "
            "dimension. Fix: replicate the mask (Replicate() on every mesh dimension)."
        )
    return next(iter(placements))


def _candidates(
    op: OpOverload,
    q: DTensorSpec,
    kv_heads: int,
    mask: DTensorSpec | None,
    n_out: int,
    n_in: int,
) -> list[_Candidate]:
    """Replicated, heads-sharded and batch-sharded candidates, each with ``n_out`` outputs and
    ``n_in`` tensor inputs placed alike (q's layout), plus the mask where it must stay."""
    kinds: list[tuple[Placement, int | None]] = [(Replicate(), None)]
    if kv_heads == q.shape[1] or kv_heads % q.mesh.size() == 0:  # whole GQA groups per rank
        kinds.append((Shard(1), 3))
    kinds.append((Shard(0), 4))
    where = _mask_where(mask, op) if mask is not None else None
    shape = tuple(mask.shape) if mask is not None else ()
    out: list[_Candidate] = []
    for placement, dim_from_end in kinds:
        inputs: list[Placement | None] = [placement] * n_in
        if mask is not None:
            keep = Replicate() if dim_from_end is None else _mask_placement(mask, dim_from_end)
            if keep != where:
                continue  # the mask would have to move, and DTensor never moves a kwarg
            inputs.append(keep)
        out.append(([placement] * n_out, inputs))
    if not out:
        raise AttentionMaskPlacementError(
            f"{op}: attn_mask {shape} is placed {where}, which no exact strategy of this "
            "kernel keeps (the mask may be replicated, or sharded like q on the heads or batch "
            "dimension it has in full). Fix: replicate the mask, or shard its heads (batch) "
            "dimension where q's heads (batch) are sharded."
        )
    return out


def _flash_cpu(
    query: DTensorSpec,
    key: DTensorSpec,
    value: DTensorSpec,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: DTensorSpec | None = None,
    scale: float | None = None,
) -> list[_Candidate]:
    # outputs: (out, logsumexp); tensor inputs: q, k, v (then the mask)
    return _candidates(FLASH_CPU, query, key.shape[1], attn_mask, 2, 3)


def _flash_cpu_backward(
    grad_out: DTensorSpec,
    query: DTensorSpec,
    key: DTensorSpec,
    value: DTensorSpec,
    out: DTensorSpec,
    logsumexp: DTensorSpec,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: DTensorSpec | None = None,
    scale: float | None = None,
) -> list[_Candidate]:
    # outputs: (grad_q, grad_k, grad_v); tensor inputs: grad_out, q, k, v, out, logsumexp
    return _candidates(FLASH_CPU_BACKWARD, query, key.shape[1], attn_mask, 3, 6)


_STRATEGIES: Sequence[tuple[OpOverload, Callable[..., list[_Candidate]]]] = (
    (FLASH_CPU, _flash_cpu),
    (FLASH_CPU_BACKWARD, _flash_cpu_backward),
)


def register_missing_strategies() -> tuple[OpOverload, ...]:
    """Register hp's strategies for every op of this module DTensor has none for.

    Idempotent: an op with a registered strategy (torch's own, in a later torch, or the one
    an earlier call registered) is left alone. Returns the ops registered by this call."""
    registered: list[OpOverload] = []
    for op, fn in _STRATEGIES:
        if has_strategy(op):
            continue
        register_sharding(op)(fn)
        # Key DTensor's sharding cache on the mask too (register_sharding keys only on
        # integer keyword arguments), or a call with another mask reuses this decision.
        infos = _propagator().op_to_schema_info
        infos[op] = dataclasses.replace(infos[op], static_kwargkey=["attn_mask"])
        registered.append(op)
    return tuple(registered)


def validate_attention_kernels(mesh: DeviceMesh) -> contextlib.AbstractContextManager[None]:
    """The attention kernels a dispatching region may use in validate mode.

    On CPU, the platform's default: its flash kernel has the strategies above. Elsewhere the
    math kernel, whose ops DTensor shards exactly: torch's strategies for the fused GPU
    kernels have not been run against hp's strict regions (a masked call may need a
    redistribution a strict region refuses), so validate keeps to what runs everywhere.
    """
    if mesh.device_type == "cpu":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.MATH])
