"""Reading a recorded program: the layout of a fused projection, and whether two agree.

:mod:`hp_core.planner.fused_proof` records the shape-changing ops a block's forward applies
to what derives from its column-sharded projections (``_Op``). Read here: how the global
program cuts or groups a fused output (its layout, and how many heads each part holds, from
the view that splits it into heads), and why a local program is not the global one scaled
by tp (``_compare``, the check of the fused-layout proof and of the local-program gate).
"""

from __future__ import annotations

import dataclasses
import itertools

from hp_core.planner.fused_layout import FusedLayout

__all__: list[str] = []


@dataclasses.dataclass(frozen=True)
class _Op:
    name: str
    direct: bool  # applied to the fused output itself (or a same-shape copy of it)
    in_shape: tuple[int, ...]
    outs: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]  # along the last dim, for cuts of the fused output
    at: int = 0  # where a direct input starts in the fused dim

    def show(self) -> str:
        outs = ", ".join(str(s) for s in self.outs)
        return f"{self.name} {self.in_shape} -> {outs}"


def _cuts(ops: list[_Op]) -> list[tuple[int, int]]:
    """``(start, width)`` of each cut of the fused output's last dim (cuts of cuts included)."""
    out: set[tuple[int, int]] = set()
    for op in ops:
        if op.direct and op.starts:
            out |= {(s, o[-1]) for s, o in zip(op.starts, op.outs, strict=True)}
    return sorted(out)


def _tiling(cuts: list[tuple[int, int]], n: int) -> tuple[int, ...] | None:
    """The finest parts every cut is made of, when the cuts cover ``[0, n)`` (else None)."""
    bounds = sorted({0, n, *(s for s, _ in cuts), *(s + w for s, w in cuts)})
    if bounds[0] < 0 or bounds[-1] > n:
        return None
    pieces = list(itertools.pairwise(bounds))
    if any(not any(s <= a and b <= s + w for s, w in cuts) for a, b in pieces):
        return None
    return tuple(b - a for a, b in pieces)


def _layout_of(ops: list[_Op], hint: FusedLayout, n: int) -> FusedLayout | str:
    """The layout the global program's ops show, or why none can be read.

    Every boundary of every cut (a cut of a cut too: ``q, kv = split(...)`` then
    ``kv.chunk(2)``) is a part boundary: each rank must hold its rows of each piece.
    """
    direct = [op for op in ops if op.direct]
    if not direct:
        return "its forward applies no split, slice or view to the fused output"
    cuts = _cuts(ops)
    if cuts and direct[0].starts:
        tiled = _tiling(cuts, n)
        if tiled is None:
            return f"the forward's cuts {cuts} do not tile the fused dim of {n}"
        parts = tiled
        if parts == hint.parts:
            return hint
        per = sum(hint.units) if len(hint.parts) > 1 else hint.units[0] * len(parts)
        unit = n // per if per and n % per == 0 else 0
        units = tuple(w // unit if unit and w % unit == 0 else 0 for w in parts)
        same = len(hint.names) == len(parts)
        unread = len(parts) == 3 and hint.units == (0,)  # q, k and v, as the forward cuts them
        names = ("q", "k", "v") if unread else hint.names if same else ()
        names = names or tuple(f"part{i}" for i in range(len(parts)))
        kind = "gate_up" if hint.kind == "gate_up" else "concatenated"
        return FusedLayout(kind, hint.dim, parts, units, names)
    op = direct[0]
    if op.name in ("view", "reshape", "unflatten") and len(op.outs) == 1:
        shape, lead = op.outs[0], op.in_shape[:-1]
        if len(shape) > len(op.in_shape) and shape[: len(lead)] == lead:
            groups = shape[len(lead)]
            per_head = groups == hint.units[0] and hint.kind != "grouped"
            kind = "interleaved" if per_head else "grouped"
            return FusedLayout(kind, hint.dim, (n,), (groups,), ("qkv",))
    return f"the first op on the fused output, {op.show()}, neither cuts nor groups its last dim"


def _compare(g_ops: list[_Op], l_ops: list[_Op], tp: int) -> str | None:
    """Why the local program is not the global one scaled by tp units (None: it is)."""
    if [o.name for o in g_ops] != [o.name for o in l_ops]:
        names = [o.name for o in g_ops]
        return f"the local program applies the ops {[o.name for o in l_ops]}, the global {names}"
    for g, loc in zip(g_ops, l_ops, strict=True):
        if len(g.outs) != len(loc.outs):
            return f"{g.show()} gives {len(loc.outs)} outputs locally ({loc.show()})"
        grows = g.name in ("view", "reshape", "unflatten") and len(g.outs[0]) > len(g.in_shape)
        for gs, ls in zip(g.outs, loc.outs, strict=True):
            differ = [i for i, (a, b) in enumerate(zip(gs, ls, strict=False)) if a != b]
            scaled = len(gs) == len(ls) and all(gs[i] == ls[i] * tp for i in differ)
            if not scaled or len(differ) > 1 or (grows and differ == [len(gs) - 1]):
                return f"{g.show()} becomes {loc.show()} on tp={tp}"
    return None


def _units_from_views(ops: list[_Op], layout: FusedLayout) -> FusedLayout:
    """``layout`` with each part's unit count read off the view that splits it into heads
    (``(..., width) -> (..., units, per-unit)``); a part no view splits keeps 0."""
    units = list(layout.units)
    starts = [sum(layout.parts[:i]) for i in range(len(layout.parts))]
    for i, (start, width) in enumerate(zip(starts, layout.parts, strict=True)):
        for op in ops:
            grows = op.name in ("view", "reshape", "unflatten") and len(op.outs) == 1
            if not (op.direct and grows and op.at == start and op.in_shape[-1:] == (width,)):
                continue
            lead = len(op.in_shape) - 1
            out = op.outs[0]
            if len(out) > len(op.in_shape) and out[:lead] == op.in_shape[:lead]:
                units[i] = int(out[lead])
                break
    return dataclasses.replace(layout, units=tuple(units))
