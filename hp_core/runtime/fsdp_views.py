"""A production parameter under FSDP2 on dp, as a checkpoint sees it and back.

``fully_shard`` on the dp mesh turns hp's plain local shard into FSDP's DTensor over dp
whose *global* shape is that local shard: every tp rank would save the same key with
different contents. ``combined_view`` rewrites it, without a copy, as one DTensor over the
dp dims plus hp's layout dims (the mesh FSDP2 itself builds for a tp DTensor parameter),
with hp's placements on the layout dims and FSDP's on dp. On a dim hp shards too, FSDP's
split happens inside hp's, which DTensor spells ``_StridedShard(dim, split_factor=hp's
shards)``. ``fsdp_local`` is the inverse: whatever a checkpoint offers becomes exactly the
form FSDP holds (its dp DTensor and spec), so FSDP's ``param.copy_`` takes it.

``_StridedShard`` misplaces some uneven splits (with dp >= 3, where FSDP leaves a dp rank
fewer rows than the others: 4 rows over dp=3 are 2+2+0). A strided view is therefore
checked, for every rank, against where hp and FSDP really hold the values (hp's shard
offset plus FSDP's inside it); where they differ the view is hp's shard gathered over dp
instead, a copy of that parameter's tp shard that ``load_state_dict``
(``set_model_state_dict``) reads back. ``fsdp_box`` says, by the same arithmetic, which
global rows and columns a rank's FSDP piece holds (what ``load_pretrained`` reads after
``fully_shard``).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset,
    compute_local_shape_and_global_offset,
)
from torch.distributed.tensor.placement_types import _StridedShard

from hp_core.errors import HpError

if TYPE_CHECKING:
    from hp_core.runtime.param_layout import ParamLayout

__all__ = ["FsdpViewError", "combined_view", "fsdp_box", "fsdp_local", "is_fsdp_shard"]


class FsdpViewError(HpError, ValueError):
    """An FSDP2 dp DTensor that cannot be combined with hp's layout of the same parameter."""


def _local_shape_and_offset(
    shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    local, offset = compute_local_shape_and_global_offset(list(shape), mesh, placements)
    return tuple(int(n) for n in local), tuple(int(o) for o in offset)


def _dp_positions(key: str, dp_mesh: DeviceMesh, layout: ParamLayout) -> tuple[int, ...]:
    """Where FSDP's dp dims sit in hp's layout mesh: ``()`` when the meshes share no dim,
    their indices when hp's layout holds them (replicated, the same ranks)."""
    dp_names = tuple(dp_mesh.mesh_dim_names or ())
    names = tuple(layout.mesh.mesh_dim_names or ())
    if not set(dp_names) & set(names):
        return ()
    positions = tuple(names.index(n) for n in dp_names if n in names)
    if (
        len(positions) != len(dp_names)
        or any(not isinstance(layout.placements[i], Replicate) for i in positions)
        or layout.mesh[dp_names] != dp_mesh
    ):
        raise FsdpViewError(
            f"{key}: FSDP2 shards it over the mesh dims {dp_names}, but hp lays it out as "
            f"{layout.describe()}: the same names with other ranks or other placements.\n"
            "A checkpoint can only say where a value sits when FSDP's dims are dims hp "
            "leaves replicated (or dims hp's mesh does not have).\n"
            "Fix: pass fully_shard a dp mesh sliced from the mesh given to hp_core.apply, "
            'e.g. fully_shard(module, mesh=mesh["dp"]).'
        )
    return positions


def is_fsdp_shard(value: DTensor, layout: ParamLayout) -> bool:
    """True when ``value`` is a wrapper's DTensor of this rank's shard of ``layout`` (FSDP2
    on dp): its global shape is hp's local shard, on a mesh other than hp's."""
    if value.device_mesh == layout.mesh:
        return False
    local, _ = _local_shape_and_offset(layout.shape, layout.mesh, layout.placements)
    return tuple(value.shape) == local


def fsdp_box(
    key: str, value: DTensor, layout: ParamLayout | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where this rank's FSDP local tensor sits in the parameter's global tensor:
    ``(shape, global offset)``. ``layout`` is hp's (None: hp replicates the parameter).

    hp's shard is a box of the global tensor (at its layout's offset) and FSDP's chunk of
    it a box inside (at FSDP's offset in the shard), so the sum is exact for every split,
    the uneven ones a ``_StridedShard`` view misplaces included.
    """
    outer: tuple[int, ...] = (0,) * value.ndim
    if layout is not None:
        shard, outer = _local_shape_and_offset(layout.shape, layout.mesh, layout.placements)
        if shard != tuple(value.shape):
            raise FsdpViewError(
                f"{key}: FSDP2's DTensor has the global shape {tuple(value.shape)}, but hp's "
                f"shard of {layout.describe()} on this rank is {shard}.\n"
                "FSDP2 must wrap hp's local shard for its pieces to say where they sit.\n"
                'Fix: call fully_shard(module, mesh=mesh["dp"]) after hp_core.apply, on the '
                "model apply returned, and do not re-shard its parameters in between."
            )
    local, inner = _local_shape_and_offset(value.shape, value.device_mesh, value.placements)
    return local, tuple(a + b for a, b in zip(outer, inner, strict=True))


def _combined(
    key: str, value: DTensor, layout: ParamLayout, gathered: bool = False
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh over dp and hp's dims, and the placements of FSDP's shard on it.

    On a tensor dim hp shards over mesh dims after dp's, FSDP's split happens inside hp's
    shard: ``_StridedShard`` with hp's shard count there. ``gathered``: dp replicated.
    """
    dp_mesh = value.device_mesh
    positions = _dp_positions(key, dp_mesh, layout)
    if positions:  # hp's layout holds the dp dims already (replicated)
        mesh, placements = layout.mesh, list(layout.placements)
    else:
        mesh = _concatenate(key, dp_mesh, layout)
        positions = tuple(range(dp_mesh.ndim))
        placements = [Replicate()] * dp_mesh.ndim + list(layout.placements)
    if not gathered:
        for i, p in zip(positions, value.placements, strict=True):
            placements[i] = p
            if isinstance(p, Shard):
                factor = 1
                for j in range(i + 1, mesh.ndim):
                    q = placements[j]
                    if isinstance(q, Shard) and q.dim == p.dim and j not in positions:
                        factor *= mesh.size(j)
                if factor > 1:
                    placements[i] = _StridedShard(p.dim, split_factor=factor)
    return mesh, tuple(placements)


def _concatenate(key: str, dp_mesh: DeviceMesh, layout: ParamLayout) -> DeviceMesh:
    try:
        return DeviceMesh._concatenate([dp_mesh, layout.mesh])
    except RuntimeError as e:
        raise FsdpViewError(
            f"{key}: FSDP2's mesh {dp_mesh.mesh_dim_names} and hp's layout mesh "
            f"{layout.mesh.mesh_dim_names} do not combine into one mesh ({e}).\n"
            "The checkpoint needs one mesh over both to say where each rank's values sit.\n"
            "Fix: pass fully_shard a dp mesh sliced from the mesh given to hp_core.apply, "
            'e.g. fully_shard(module, mesh=mesh["dp"]).'
        ) from e


def _is_shard(p: Placement) -> TypeGuard[Shard | _StridedShard]:
    return isinstance(p, (Shard, _StridedShard))


@functools.lru_cache(maxsize=1024)
def _strided_is_exact(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    dp_placements: tuple[tuple[int, Placement], ...],
) -> bool:
    """Whether ``placements`` put every rank's values where hp + FSDP hold them.

    For each mesh coordinate: hp's shard (``placements`` with dp replicated), FSDP's
    chunk of it over dp, against what the combined placements say. Pure arithmetic, the
    same on every rank, so every rank takes the same branch (the fallback gathers).
    """
    if not any(isinstance(p, _StridedShard) for p in placements):
        return True  # left-to-right Shards nest as hp's then FSDP's chunks do
    hp = list(placements)
    for i, _ in dp_placements:
        hp[i] = Replicate()
    sharded = [(n, p) for n, p in zip(mesh_shape, placements, strict=True) if _is_shard(p)]
    shards = math.prod(n for n, _ in sharded)
    if all(shape[p.dim] % shards == 0 for _, p in sharded):
        return True  # even everywhere: nothing to misplace
    dp_shape = tuple(mesh_shape[i] for i, _ in dp_placements)
    fsdp = [p for _, p in dp_placements]
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        outer_shape, outer = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coord), hp
        )
        dp_coord = [coord[i] for i, _ in dp_placements]
        local, inner = _compute_local_shape_and_global_offset(outer_shape, dp_shape, dp_coord, fsdp)
        got_shape, got = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coord), placements
        )
        true = tuple(a + b for a, b in zip(outer, inner, strict=True))
        if got_shape != local or (math.prod(local) > 0 and got != true):
            return False
    return True


def _exact(
    key: str,
    value: DTensor,
    layout: ParamLayout,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
) -> bool:
    dp_ndim = value.device_mesh.ndim
    positions = _dp_positions(key, value.device_mesh, layout) or tuple(range(dp_ndim))
    return _strided_is_exact(
        tuple(layout.shape),
        tuple(mesh.shape),
        placements,
        tuple(zip(positions, value.placements, strict=True)),
    )


def combined_view(key: str, value: DTensor, layout: ParamLayout) -> DTensor:
    """FSDP's dp DTensor ``value`` as one DTensor over dp + hp's layout dims (a view)."""
    mesh, placements = _combined(key, value, layout)
    local = value.to_local()
    if not _exact(key, value, layout, mesh, placements):
        # torch misplaces this uneven split: hp's shard gathered over dp (a copy, this key only)
        mesh, placements = _combined(key, value, layout, gathered=True)
        whole = value.redistribute(value.device_mesh, [Replicate()] * value.device_mesh.ndim)
        local = whole.to_local()
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=layout.shape, stride=layout.stride
    )


def _hp_shard(key: str, value: torch.Tensor, layout: ParamLayout, like: DTensor) -> torch.Tensor:
    """This rank's shard of ``layout`` (hp's local shard, whole over dp) from ``value``."""
    if not isinstance(value, DTensor):  # the full tensor: every rank holds it, slice it
        return distribute_tensor(
            value.detach(), layout.mesh, layout.placements, src_data_rank=None
        ).to_local()
    mesh, gathered = _combined(key, like, layout, gathered=True)
    if value.device_mesh == mesh:
        return value.redistribute(mesh, gathered).to_local()
    if value.device_mesh == layout.mesh:
        return value.redistribute(layout.mesh, layout.placements).to_local()
    # Another mesh altogether: DTensor cannot redistribute across meshes; go through the
    # full tensor (one collective on the value's own mesh, then a local slice).
    return _hp_shard(key, value.full_tensor(), layout, like)


def fsdp_local(key: str, value: torch.Tensor, layout: ParamLayout, like: DTensor) -> DTensor:
    """``value`` (the full tensor, or a DTensor of any layout of it) in ``like``'s form:
    FSDP's dp DTensor over this rank's slice of hp's shard."""
    dp_mesh = like.device_mesh
    if isinstance(value, DTensor):
        mesh, placements = _combined(key, like, layout)
        if (
            value.device_mesh == mesh
            and tuple(value.placements) == placements
            and _exact(key, like, layout, mesh, placements)
        ):  # what combined_view saved: this rank's values already
            return DTensor.from_local(
                value.to_local(),
                dp_mesh,
                like.placements,
                run_check=False,
                shape=like.shape,
                stride=like.stride(),
            )
    shard = _hp_shard(key, value, layout, like)
    local_shape, offset = _local_shape_and_offset(like.shape, dp_mesh, like.placements)
    piece = shard
    for dim, (size, start) in enumerate(zip(local_shape, offset, strict=True)):
        if size != shard.shape[dim]:
            piece = piece.narrow(dim, start, size)
    return DTensor.from_local(
        piece, dp_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )
