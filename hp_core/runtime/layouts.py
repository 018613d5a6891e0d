"""Redistributing tensors between layouts: the communication a contract implies.

A ``Redistribution`` is built once per boundary input/output at apply time and called on
every forward. Production lowers a change on a single mesh axis to the autograd
collective that row of ``hp_core.collectives.TRANSITIONS`` names (the same table the
planner predicts from); anything else — several axes at once, a row with no lowering, or
a shard whose order on the mesh the lowering cannot honour — falls back to DTensor's
``redistribute``. Validate mode always goes through DTensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from hp_core.collectives import rule
from hp_core.errors import HpError
from hp_core.mesh import is_data_axis, mesh_axes
from hp_core.spec.placements import resolve_placements

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["InputLayoutError", "Redistribution", "dense_mesh", "same_placement", "to_placements"]


class _Unwrap(torch.autograd.Function):
    """``DTensor.to_local`` whose result is no view: a boundary's output is the model's own
    tensor again, and model code may update it in place (Falcon's ``mlp_output +=
    attention_output``), which autograd forbids on a view a custom Function made. It shares
    the local tensor's storage and version counter, so nothing is copied and an in-place
    change to something saved for backward is still caught."""

    @staticmethod
    def forward(ctx: Any, dt: DTensor, grad: tuple[Placement, ...] | None) -> torch.Tensor:
        ctx.mesh, ctx.placements = dt.device_mesh, tuple(grad or dt.placements)
        ctx.shape, ctx.stride = dt.shape, dt.stride()
        return dt._local_tensor.detach()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[DTensor, None]:
        dt = DTensor.from_local(
            g, ctx.mesh, ctx.placements, run_check=False, shape=ctx.shape, stride=ctx.stride
        )
        return dt, None


def unwrap(dt: DTensor, grad: Sequence[Placement] | None = None) -> torch.Tensor:
    """The local tensor of ``dt`` (gradient in ``grad``, default ``dt``'s own placements)."""
    return _Unwrap.apply(dt, tuple(grad) if grad is not None else None)


class InputLayoutError(HpError, ValueError):
    """An input the plan's layouts cannot split (an uneven shard), refused before any collective."""


def dense_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sub-mesh of ``mesh`` without its data-parallel axes: where hp's DTensors live.

    The plan describes one data-parallel slice, so nothing of hp's is placed along ``dp*``;
    keeping hp's DTensors off those axes is also what lets FSDP2 shard them over ``dp``.
    """
    names = [n for n in (mesh.mesh_dim_names or ()) if not is_data_axis(n)]
    if not names or len(names) == mesh.ndim:
        return mesh
    return mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]


def to_placements(named: Mapping[str, Placement] | None, mesh: DeviceMesh) -> tuple[Placement, ...]:
    return tuple(resolve_placements(dict(named or {}), list(mesh_axes(mesh))))


def same_placement(actual: Placement, expected: Placement) -> bool:
    """Equality that treats DTensor's masked partial (vocab-parallel lookup) as ``partial``."""
    if isinstance(expected, Partial):
        return (
            isinstance(actual, Partial)
            and getattr(actual, "reduce_op", "sum") == expected.reduce_op
        )
    return actual == expected


class Redistribution:
    """``src → dst`` for one tensor on one mesh; ``grad_partial_axes`` marks partial gradients."""

    def __init__(
        self,
        src: Mapping[str, Placement] | None,
        dst: Mapping[str, Placement] | None,
        mesh: DeviceMesh,
        *,
        grad_partial_axes: Sequence[str] = (),
        where: str = "",
    ) -> None:
        self.mesh = mesh
        self.where = where
        self.names = list(mesh_axes(mesh))
        self.src = to_placements(src, mesh)
        self.dst = to_placements(dst if dst is not None else src, mesh)
        self.grad = tuple(
            Partial() if (name in grad_partial_axes and isinstance(d, Replicate)) else d
            for name, d in zip(self.names, self.dst, strict=True)
        )
        self.identity = self.src == self.dst and self.grad == self.dst
        self._local = None if self.identity else self._lower()
        # (tensor dim, axis name, axis size) of every split this transition makes
        self._splits = [
            (d.dim, name, int(size))
            for name, size, s, d in zip(self.names, mesh.shape, self.src, self.dst, strict=True)
            if isinstance(d, Shard) and not isinstance(s, Shard) and int(size) > 1
        ]

    # --------------------------------------------------------------- lowering
    def _lower(self) -> Any:
        changed = [
            i
            for i, (s, d, g) in enumerate(zip(self.src, self.dst, self.grad, strict=True))
            if s != d or g != d
        ]
        if len(changed) != 1:
            return None
        i = changed[0]
        s, d, g = self.src[i], self.dst[i], self.grad[i]
        dim = s.dim if isinstance(s, Shard) else d.dim if isinstance(d, Shard) else None
        if dim is not None:
            # Single-axis lowering is exact only when no inner mesh axis also shards `dim`.
            for j in range(i + 1, len(self.names)):
                if any(isinstance(p, Shard) and p.dim == dim for p in (self.src[j], self.dst[j])):
                    return None
        lower = rule(s, d, grad_partial=isinstance(g, Partial)).lower
        if lower is None:
            return None
        group = self.mesh.get_group(self.names[i])
        return lambda x: lower(x, dim, group)

    # --------------------------------------------------------------- checks
    def check_split(self, x: torch.Tensor) -> None:
        """Refuse, before any collective, a tensor that a split cannot divide evenly.

        Every rank of the group holds the same shape (the input guard made sure), so every
        rank refuses together instead of aborting in a mismatched collective later.
        """
        for dim, axis, size in self._splits:
            if dim >= x.dim():
                continue
            n = x.shape[dim]
            if n % size:
                decode = not torch.is_grad_enabled() and n < size
                raise InputLayoutError(
                    f"{self.where}: this tensor has {n} positions along dim {dim}, which "
                    f"{axis}={size} cannot split evenly (shape {tuple(x.shape)}). "
                    + (
                        (
                            "Decoding one token at a time (generate() with a KV cache) cannot be "
                            "split by sequence parallelism: apply a plan with "
                            "sequence_parallel=False for generation."
                        )
                        if decode
                        else (
                            f"Pad it to a multiple of {size} (mask the padding: "
                            "attention_mask 0, labels -100)."
                        )
                    )
                )

    # --------------------------------------------------------------- calls
    def local(self, x: torch.Tensor) -> torch.Tensor:
        """Production: local tensor in ``src`` → local tensor in ``dst``."""
        if self.identity or not isinstance(x, torch.Tensor):
            return x
        if self._splits:
            self.check_split(x)
        if self._local is not None:
            return self._local(x)
        dt = DTensor.from_local(x, self.mesh, self.src, run_check=False)
        return unwrap(dt.redistribute(self.mesh, self.dst), self.grad)

    def to_dtensor(self, x: torch.Tensor) -> DTensor:
        """Validate, dispatching region: local ``src`` → DTensor in ``dst``."""
        if self._splits:
            self.check_split(x)
        dt = DTensor.from_local(x, self.mesh, self.src, run_check=False)
        return dt.redistribute(self.mesh, self.dst) if self.src != self.dst else dt

    def via_dtensor(self, x: torch.Tensor) -> torch.Tensor:
        """Validate, local region: local ``src`` → local ``dst`` through DTensor."""
        if not isinstance(x, torch.Tensor):
            return x
        return unwrap(self.to_dtensor(x), self.grad)

    def exit_dtensor(self, dt: DTensor) -> torch.Tensor:
        """Validate: a DTensor the region made (already checked against ``src``) → local ``dst``."""
        if tuple(dt.placements) == self.dst:
            return unwrap(dt)
        return unwrap(dt.redistribute(self.mesh, self.dst))
