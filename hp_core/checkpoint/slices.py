"""This rank's slice of a model tensor, read from the checkpoint pieces that make it.

A sharded parameter's layout (mesh, placements, global shape) says which global index
range this rank holds along each dim (``torch.distributed.tensor``'s own chunking, so the
slice is exactly the one ``distribute_tensor`` would keep). ``read_local`` reads that range
and nothing else: for a plain checkpoint tensor one lazy ``get_slice``; for experts stacked
from per-expert tensors, the owned experts only, and of each only the rows that fall in
the range.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hp_core.checkpoint import safetensors_files
from hp_core.checkpoint.key_map import Piece, Source
from hp_core.runtime.fused import FusedShards
from hp_core.runtime.param_layout import ParamLayout

__all__ = ["local_ranges", "plain_placements", "read_fused_local", "read_local"]

Ranges = tuple[tuple[int, int], ...]


def plain_placements(layout: ParamLayout) -> bool:
    """Whether every placement is ``Shard`` or ``Replicate`` (what ``local_ranges`` handles)."""
    return all(type(p) in (Shard, Replicate) for p in layout.placements)


def local_ranges(shape: tuple[int, ...], layout: ParamLayout | None) -> Ranges:
    """This rank's ``(start, stop)`` along each dim of a tensor of global ``shape``."""
    if layout is None:
        return tuple((0, n) for n in shape)
    local, offset = compute_local_shape_and_global_offset(
        torch.Size(shape), layout.mesh, layout.placements
    )
    return tuple((o, o + n) for o, n in zip(offset, local, strict=True))


def _read(piece: Piece, ranges: Ranges) -> torch.Tensor:
    return safetensors_files.read_slice(piece.entry, tuple(slice(a, b) for a, b in ranges))


def read_local(source: Source, ranges: Ranges) -> torch.Tensor:
    """The ``ranges`` slice of the tensor ``source`` makes, on the CPU in the file's dtype."""
    first = source.pieces[0]
    if first.expert is None:
        return _read(first, ranges)
    shape = tuple(b - a for a, b in ranges)
    out = torch.empty(shape, dtype=first.entry.dtype)
    (e0, e1), (r0, r1), rest = ranges[0], ranges[1], ranges[2:]
    for piece in source.pieces:
        if piece.expert is None or not e0 <= piece.expert < e1:
            continue  # another rank's expert: not read
        # The piece's rows are [offset, offset + rows) of the concatenated dim.
        lo = max(r0, piece.offset)
        hi = min(r1, piece.offset + piece.entry.shape[0])
        if lo >= hi:
            continue
        part = _read(piece, ((lo - piece.offset, hi - piece.offset), *rest))
        out[piece.expert - e0, lo - r0 : hi - r0] = part
    return out


def read_fused_local(source: Source, ranges: Ranges, fused: FusedShards) -> torch.Tensor:
    """This rank's shard of a re-arranged fused parameter: its rows of every part.

    ``ranges`` are the shard's ranges in the re-arranged tensor; along the fused dim they
    map to one run of the checkpoint's rows per part, each read on its own.
    """
    dim = fused.layout.dim
    index = fused.layout.index(fused.tp)
    lo, hi = ranges[dim]
    if index is None:
        return read_local(source, ranges)
    rows = index[lo:hi].tolist()
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    pieces = [read_local(source, (*ranges[:dim], run, *ranges[dim + 1 :])) for run in runs]
    return torch.cat(pieces, dim=dim)
