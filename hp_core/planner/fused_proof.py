"""The proof gate of fused layouts: the forward tp runs must be the global one, scaled by units.

A fused layout (``hp_core.planner.fused_layout``) claims how the module's forward splits a
fused projection's output. Config values cannot prove it (CodeGen's forward groups
``qkv_proj`` by a constant four). So each distinct block is traced twice on the meta
device, with a ``TorchFunctionMode`` recording the shape-changing ops (split, chunk,
slicing, view, reshape, unbind, transpose, ...) applied to what derives from the fused
output:

1. the global program: a meta clone of the block (no value of the model is copied) called
   with the arguments the model's own forward passes it (captured in one meta run of the
   whole model);
2. the local program production runs: the clone with each tp-sharded parameter at its
   local shape and the tp-local attributes the plan sets (``compute_tp_local_attrs``).

The layout is read off the global program: the first ops on the fused output either cut
its last dim into contiguous parts (concatenated ``[Q; K; V]``, ``[gate; up]``) or view it
as ``(units, width)`` (per-head interleaved, per-group). It is accepted only when the local
program is the global one op by op, with unit counts divided by tp and every per-unit
width unchanged. Anything else (a constant group count, a different path, a forward that
does not run on meta) is a ``FusedProjectionError`` naming the op and both shapes, raised
at plan time, before any collective. Each distinct block (class, shapes, attributes,
placements) is proven once, so planning stays linear in depth.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import itertools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.fx.experimental import _config as fx_config
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from hp_core.mesh import MeshSpec
from hp_core.planner.fused_layout import FusedLayout, keep_whole
from hp_core.planner.lints import FusedProjectionError, compute_tp_local_attrs
from hp_core.planner.trace import META_ANSWERS, meta_operands
from hp_core.plans.example import ExampleCall, default_call
from hp_core.spec.module_spec import ModuleShardingSpec

__all__ = ["prove_fused_layouts"]

_STRUCTURAL = frozenset(
    {
        "view",
        "reshape",
        "split",
        "split_with_sizes",
        "chunk",
        "tensor_split",
        "unbind",
        "__getitem__",
        "narrow",
        "unflatten",
        "flatten",
        "transpose",
        "permute",
    }
)

#: Per-layer indices (the cache slot a layer writes) that do not change the program.
_INDEX_NAMES = ("layer_idx", "layer_id", "layer_number", "block_idx", "layer_index")


@dataclasses.dataclass(frozen=True)
class _Op:
    name: str
    direct: bool  # applied to the fused output itself (or a same-shape copy of it)
    in_shape: tuple[int, ...]
    outs: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]  # along the last dim, for cuts of the fused output

    def show(self) -> str:
        outs = ", ".join(str(s) for s in self.outs)
        return f"{self.name} {self.in_shape} -> {outs}"


class _Recorder(TorchFunctionMode):
    """Records the shape-changing ops on what derives from the outputs in ``roots``."""

    def __init__(self) -> None:
        super().__init__()
        self.roots: dict[int, str] = {}  # id(tensor) -> fused param it derives from
        self.direct: set[int] = set()
        self.offset: dict[int, int] = {}  # id(direct tensor) -> where it starts in the fused dim
        self.keep: list[torch.Tensor] = []
        self.ops: dict[str, list[_Op]] = {}

    def mark(self, out: Any, rel: str) -> None:
        if isinstance(out, torch.Tensor) and rel not in self.ops:
            self._track(out, rel, direct=True)
            self.ops[rel] = []

    def _track(self, t: torch.Tensor, rel: str, direct: bool, offset: int = 0) -> None:
        self.roots[id(t)] = rel
        self.keep.append(t)  # keeps ids unique while the trace runs
        if direct:
            self.direct.add(id(t))
            self.offset[id(t)] = offset

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in META_ANSWERS:
            return META_ANSWERS[func]
        args, kwargs = meta_operands(args, kwargs)
        out = func(*args, **kwargs)
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        src = next((t for t in ins if id(t) in self.roots), None)
        if src is None:
            return out
        rel = self.roots[id(src)]
        direct = id(src) in self.direct
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        name = getattr(func, "__name__", str(func))
        at = self.offset.get(id(src), 0)
        starts = _starts(name, src, args, outs) if direct and name in _STRUCTURAL else ()
        starts = tuple(at + s for s in starts)
        if name in _STRUCTURAL:
            shapes = tuple(tuple(t.shape) for t in outs)
            self.ops[rel].append(_Op(name, direct, tuple(src.shape), shapes, starts))
        for i, t in enumerate(outs):
            # A same-shape op (clamp, dropout, a cast) of the fused output is still it, and a
            # cut of it is a contiguous piece of the fused dim (which may be cut again).
            same = direct and tuple(t.shape) == tuple(src.shape) and name not in _STRUCTURAL
            self._track(t, rel, same or bool(starts), starts[i] if starts else at)
        return out


def _starts(
    name: str, src: torch.Tensor, args: tuple[Any, ...], outs: list[torch.Tensor]
) -> tuple[int, ...]:
    """Where each output of a cut of ``src``'s last dim starts (empty when it is no such cut)."""
    if not src.dim() or any(t.dim() != src.dim() for t in outs):
        return ()
    if name == "__getitem__":
        index = args[1] if len(args) > 1 else None
        key = index[-1] if isinstance(index, tuple) and index else index
        if not isinstance(key, slice):
            return ()
        return (range(src.shape[-1])[key].start,) if outs[0].shape[:-1] == src.shape[:-1] else ()
    if any(t.shape[:-1] != src.shape[:-1] for t in outs):
        return ()
    starts, at = [], 0
    for t in outs:
        starts.append(at)
        at += int(t.shape[-1])
    return tuple(starts) if at == src.shape[-1] else ()


def _meta_param(t: torch.Tensor, shape: tuple[int, ...] | None = None) -> Any:
    meta = torch.empty(shape if shape is not None else t.shape, dtype=t.dtype, device="meta")
    return (
        nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    )


def _clone(block: nn.Module) -> nn.Module:
    """A meta copy of ``block``: no value is copied, the block is not touched."""
    memo: dict[int, Any] = {}
    for t in [*block.parameters(), *block.buffers()]:
        memo[id(t)] = _meta_param(t)
    return copy.deepcopy(block, memo)


def _run(
    clone: nn.Module, owners: Mapping[str, str], call: tuple[tuple[Any, ...], dict[str, Any]]
) -> dict[str, list[_Op]]:
    """Call ``clone`` and return the ops on each fused output (``owners``: rel -> owner path)."""
    rec = _Recorder()
    handles = []
    for rel, path in owners.items():
        owner = clone.get_submodule(path)
        handles.append(owner.register_forward_hook(lambda m, a, o, rel=rel: rec.mark(o, rel)))
    try:
        with torch.no_grad(), rec:
            clone(*call[0], **call[1])
    finally:
        for h in handles:
            h.remove()
    return rec.ops


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
        names = hint.names if same else tuple(f"part{i}" for i in range(len(parts)))
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


def _local_clone(
    block: nn.Module, spec: ModuleShardingSpec, tp: int, attrs: Mapping[str, tuple[int, int]]
) -> nn.Module:
    """The clone with its tp-sharded parameters at local shapes and the plan's local attrs."""
    clone = _clone(block)
    params = spec.params if isinstance(spec.params, dict) else {}
    for rel, named in params.items():
        placement = named.get("tp")
        if not isinstance(placement, Shard):
            continue
        path, _, leaf = rel.rpartition(".")
        owner = clone.get_submodule(path) if path else clone
        old = owner._parameters.get(leaf)
        if old is None:
            continue
        shape = list(old.shape)
        shape[placement.dim] //= tp
        owner._parameters[leaf] = _meta_param(old, tuple(shape))
    for attr, (_, local) in attrs.items():
        path, _, leaf = attr.rpartition(".")
        target: Any = (
            clone if not path else (clone.config if path == "config" else clone.get_submodule(path))
        )
        setattr(target, leaf, local)  # the clone's config is its own deep copy
    return clone


def _capture(
    model: nn.Module, fqns: set[str], call: ExampleCall | None = None
) -> dict[str, tuple[tuple[Any, ...], dict[str, Any]]]:
    """The arguments the model's forward passes each of ``fqns`` (one meta run of the model
    with ``call``, by default hp's default call)."""
    calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    class _Done(Exception):
        pass

    def hook(fqn: str) -> Callable[..., None]:
        def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls.setdefault(fqn, (args, dict(kwargs)))
            if len(calls) == len(fqns):
                raise _Done

        return pre

    meta = {
        n: torch.empty_like(t, device="meta")
        for n, t in [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]
    }
    handles = [
        model.get_submodule(f).register_forward_pre_hook(hook(f), with_kwargs=True) for f in fqns
    ]
    args, kwargs = (call or default_call(model)).meta()
    # An MoE router's nonzero on meta: assume every expert is chosen (the ordinary batch).
    nonzero = fx_config.patch(meta_nonzero_assume_all_nonzero=True)  # type: ignore[attr-defined]
    try:
        with torch.no_grad(), _Recorder(), nonzero:
            torch.func.functional_call(model, meta, args, kwargs, tie_weights=False, strict=False)
    except _Done:
        pass
    except Exception:  # what was not captured is refused by the caller
        pass
    finally:
        for h in handles:
            h.remove()
    return calls


def _key(block: nn.Module, spec: ModuleShardingSpec, tp: int) -> tuple[Any, ...]:
    """What the proof of a block depends on: blocks with one key are proven once."""
    shapes = tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters())
    scalars = tuple(
        sorted(
            (k, v)
            for k, v in vars(block).items()
            if isinstance(v, int | float | str | bool) and k not in _INDEX_NAMES
        )
    )
    config = getattr(block, "config", None)
    conf = tuple(sorted((k, repr(v)) for k, v in vars(config).items())) if config else ()
    return (type(block), shapes, scalars, conf, repr(spec.params), repr(spec._fused_layouts), tp)


def _refuse(
    fqn: str, spec: ModuleShardingSpec, block: nn.Module, tp: int, why: str, match: str = ""
) -> NoReturn:
    raise FusedProjectionError(
        f"{fqn}: hp cannot prove how {type(block).__name__}'s forward splits its fused "
        f"projection {sorted(spec._fused_layouts)} on tp={tp}: {why}. Its local shards would "
        "compute a different program, so the plan is refused before any collective.\nFix: keep "
        "the block whole on tp (an override replicating its parameters, output replicated), or "
        f"install a plugin template that declares the layout.{keep_whole(match or fqn, spec)}"
    )


def _prove(
    model: nn.Module,
    fqn: str,
    spec: ModuleShardingSpec,
    mesh: MeshSpec,
    call: tuple[tuple[Any, ...], dict[str, Any]] | None,
    match: str = "",
) -> dict[str, dict[str, Any]]:
    """The proven layouts of boundary ``fqn`` (see the module docstring), or a refusal
    (whose override matches ``match``: every block like it)."""
    tp = mesh.size("tp")
    block = model.get_submodule(fqn) if fqn else model
    hints = {r: FusedLayout.from_data(d) for r, d in spec._fused_layouts.items()}
    owners: dict[str, str] = {}
    for rel in hints:
        owners.setdefault(rel.rpartition(".")[0], rel)
    if call is None:
        _refuse(
            fqn, spec, block, tp, "the model's forward does not reach it on the meta device", match
        )
    try:
        global_ops = _run(_clone(block), {p: p for p in owners}, call)
    except Exception as e:  # any failure of user code on meta is refused
        _refuse(
            fqn,
            spec,
            block,
            tp,
            f"its forward does not run on meta ({type(e).__name__}: {e})",
            match,
        )
    proven: dict[str, dict[str, Any]] = {}
    for rel, hint in hints.items():
        path = rel.rpartition(".")[0]
        n = hint.size()
        layout = _layout_of(global_ops.get(path, []), hints[owners[path]], n)
        if isinstance(layout, str):
            _refuse(fqn, spec, block, tp, f"{path}: {layout}", match)
        layout = dataclasses.replace(layout, dim=hint.dim)
        shape = tuple(block.get_parameter(rel).shape)
        try:
            layout.check("", shape, tp)
        except FusedProjectionError as e:
            raise FusedProjectionError(
                f"{fqn}.{rel}: {str(e).lstrip(': ')}{keep_whole(match or fqn, spec)}"
            ) from None
        proven[rel] = layout.to_data()
    spec.with_derived(fused_layouts=proven)
    attrs = compute_tp_local_attrs(model, fqn, spec, mesh) or {}
    try:
        local_ops = _run(_local_clone(block, spec, tp, attrs), {p: p for p in owners}, call)
    except Exception as e:  # a local program that cannot run is refused
        _refuse(
            fqn,
            spec,
            block,
            tp,
            f"its local program fails on meta ({type(e).__name__}: {e})",
            match,
        )
    for path in owners:
        why = _compare(global_ops.get(path, []), local_ops.get(path, []), tp)
        if why is not None:
            _refuse(fqn, spec, block, tp, f"{path}: {why}", match)
    return proven


def _glob(
    fqn: str, keys: Mapping[str, tuple[Any, ...]], key: tuple[Any, ...], names: Iterable[str]
) -> str:
    """A glob matching exactly the boundaries proven with ``fqn`` (layer indices as ``*``),
    so one refusal proposes the override for all of them; ``fqn`` when there is none."""
    same = [f for f, k in keys.items() if k == key]
    glob = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", fqn)
    if len(same) < 2 or {f for f in names if fnmatch.fnmatchcase(f, glob)} != set(same):
        return fqn
    return glob


def prove_fused_layouts(
    model: nn.Module,
    modules: Mapping[str, ModuleShardingSpec],
    mesh: MeshSpec,
    call: ExampleCall | None = None,
) -> None:
    """Prove (and correct) every boundary's ``fused_layouts``; refuse what cannot be proven.

    A block whose proven layouts need no re-arrangement runs dispatched again (the template
    set ``region_dispatch: false`` only for a re-arranged layout).
    """
    tp = mesh.size("tp")
    todo = {fqn: spec for fqn, spec in modules.items() if spec._fused_layouts}
    if tp <= 1 or not todo:
        return
    keys = {fqn: _key(model.get_submodule(fqn), spec, tp) for fqn, spec in todo.items()}
    reps: dict[tuple[Any, ...], str] = {}
    for fqn, key in keys.items():
        reps.setdefault(key, fqn)
    moved = {
        f: any(len(d["parts"]) > 1 for d in s._fused_layouts.values()) for f, s in todo.items()
    }
    calls = _capture(model, set(reps.values()), call)
    proven = {
        key: _prove(model, fqn, todo[fqn], mesh, calls.get(fqn), _glob(fqn, keys, key, modules))
        for key, fqn in reps.items()
    }
    for fqn, spec in todo.items():
        layouts = {r: dict(d) for r, d in proven[keys[fqn]].items()}
        spec.with_derived(fused_layouts=layouts)
        if (
            spec.region_dispatch is False
            and moved
            and all(len(d["parts"]) == 1 for d in layouts.values())
        ):
            spec.region_dispatch = None
