"""Values shared by every shard, seen by DTensor as what they are: a broadcast, not a gather.

Inside a dispatching region some code builds a per-head tensor from a value every head
shares: multi-head latent attention expands its one rope key ``k_pe`` of shape
``[b, 1, s, r]`` to ``[b, heads, s, r]`` and copies it into a key buffer whose heads are
sharded. In production each rank expands to its own heads, which is the chunk of the
expanded tensor; DTensor instead re-slices the replicated expansion (an implicit
``Replicate → Shard``) and, in backward, all-gathers its gradient — communication the
contract does not have. :class:`BroadcastToShards` states the fact directly, below
autograd and only for two kinds of op:

* ``copy_``/``cat`` whose replicated argument is a broadcast (stride 0) along the
  dimension another argument is sharded on: that argument becomes the local chunk of the
  same broadcast, sharded like its neighbour. Autograd then sums its gradient over this
  rank's heads only, and DTensor's propagation reports it ``Partial`` — the reduction
  hp performs is derived from placements, not declared;
* ``new_empty`` (uninitialised memory) whose size keeps every dimension its input is
  sharded on: the buffer is sharded like its input, as production's local buffer is.

Nothing is communicated and no value changes: both rewrites pick a placement DTensor
would have reached by a local re-slicing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BroadcastToShards"]

_aten = torch.ops.aten
#: Factories whose result does not depend on how it is laid out (uninitialised or zeros).
_FACTORIES = (_aten.new_empty.default, _aten.new_zeros.default)


def _shard_dims(t: DTensor) -> dict[int, int]:
    """Mesh dim → tensor dim, for each mesh dim ``t`` is plainly sharded on."""
    return {i: p.dim for i, p in enumerate(t.placements) if type(p) is Shard}


def _broadcast_chunk(src: DTensor, ref: DTensor, skip_dim: int | None = None) -> DTensor | None:
    """``src`` (replicated where ``ref`` is sharded, a stride-0 broadcast there) as ``ref``'s
    placement, or None when that does not hold."""
    if src.ndim != ref.ndim or src.device_mesh != ref.device_mesh:
        return None
    wanted = _shard_dims(ref)
    if not wanted:
        return None
    local = src._local_tensor
    placements = list(src.placements)
    for mdim, tdim in wanted.items():
        if tdim == skip_dim or not isinstance(placements[mdim], Replicate):
            return None
        if local.stride(tdim) != 0 or src.shape[tdim] != ref.shape[tdim]:
            return None
        placements[mdim] = Shard(tdim)
    if any(not isinstance(p, Replicate | Shard) for p in placements):
        return None
    shape, _ = compute_local_shape_and_global_offset(src.shape, src.device_mesh, placements)
    chunk = local.as_strided(shape, local.stride(), local.storage_offset())
    return _wrap(chunk, src, placements, src.shape, src.stride())


def _sharded_new(
    func: Any, self: DTensor, size: list[int], rest: tuple[Any, ...], kwargs: dict[str, Any]
) -> DTensor | None:
    dims = _shard_dims(self)
    if not dims or any(not isinstance(p, Replicate | Shard) for p in self.placements):
        return None
    if len(size) != self.ndim or any(size[d] != self.shape[d] for d in dims.values()):
        return None
    shape, _ = compute_local_shape_and_global_offset(
        torch.Size(size), self.device_mesh, self.placements
    )
    local = func(self._local_tensor, list(shape), *rest, **kwargs)
    strides: list[int] = []
    acc = 1
    for n in reversed(size):  # a fresh buffer is contiguous
        strides.insert(0, acc)
        acc *= max(n, 1)
    return _wrap(local, self, list(self.placements), torch.Size(size), tuple(strides))


def _wrap(
    local: torch.Tensor,
    like: DTensor,
    placements: list[Any],
    shape: torch.Size,
    stride: tuple[int, ...],
) -> DTensor:
    """A DTensor around ``local`` built below autograd (no graph node: the op that receives
    it is the one autograd records)."""
    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    spec = DTensorSpec(like.device_mesh, tuple(placements), tensor_meta=meta)
    return DTensor(local, spec, requires_grad=False)


class BroadcastToShards(TorchDispatchMode):
    """Validate, dispatching region: shared broadcasts and empty buffers follow the shards."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is _aten.copy_.default and len(args) >= 2:
            dst, src = args[0], args[1]
            if isinstance(dst, DTensor) and isinstance(src, DTensor):
                chunk = _broadcast_chunk(src, dst)
                if chunk is not None:
                    return func(dst, chunk, *args[2:], **kwargs)
        elif func is _aten.cat.default and args and isinstance(args[0], list | tuple):
            pieces = list(args[0])
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            ref = next((t for t in pieces if isinstance(t, DTensor) and _shard_dims(t)), None)
            if ref is not None:
                dim = dim % ref.ndim
                for i, t in enumerate(pieces):
                    if isinstance(t, DTensor) and t is not ref and not _shard_dims(t):
                        chunk = _broadcast_chunk(t, ref, skip_dim=dim)
                        if chunk is not None:
                            pieces[i] = chunk
                return func(pieces, *args[1:], **kwargs)
        elif func in _FACTORIES and len(args) >= 2 and isinstance(args[0], DTensor):
            out = _sharded_new(func, args[0], list(args[1]), tuple(args[2:]), kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)
