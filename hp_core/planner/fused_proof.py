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

The layout is read off the global program: the first ops on the fused output either cut its
last dim into contiguous parts (concatenated ``[Q; K; V]``, ``[gate; up]``) or view it as
``(units, width)`` (per-head interleaved, per-group). It is accepted only when the local
program is the global one op by op, with unit counts divided by tp and every per-unit width
unchanged (the values it divides are searched for, as by the local-program gate, when the
known names do not suffice; a layout with no head count anywhere takes each part's from the
view that splits it into heads). Anything else (a constant group count, a different path, a
forward that does not run on meta) is a ``FusedProjectionError`` naming the op and both
shapes, raised at plan time, before any collective. Each distinct block (class, shapes,
attributes, placements) is proven once, so planning stays linear in depth.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
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
from hp_core.planner import head_search
from hp_core.planner.fused_layout import FusedLayout
from hp_core.planner.lints import FusedProjectionError, compute_tp_local_attrs, input_width
from hp_core.planner.local_width import INPUT_WIDTH, present_local
from hp_core.planner.program_reading import _compare, _layout_of, _Op, _units_from_views
from hp_core.planner.trace import META_ANSWERS, meta_operands
from hp_core.plans.example import ExampleCall, default_call
from hp_core.plans.fixes import keep_whole_proposal
from hp_core.plans.proposal import propose
from hp_core.spec.module_spec import ModuleShardingSpec

__all__ = ["local_call", "prove_fused_layouts", "record_found"]

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
            self.ops[rel].append(_Op(name, direct, tuple(src.shape), shapes, starts, at))
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
        if attr == INPUT_WIDTH:  # no attribute: the call's input is shown local instead
            continue
        path, _, leaf = attr.rpartition(".")
        target: Any = clone
        if path:  # a child's attribute, or a plain object's (the clone's own deep copy of it)
            held = "." not in path and path not in clone._modules
            target = getattr(clone, path) if held else clone.get_submodule(path)
        setattr(target, leaf, local)
    return clone


def local_call(
    call: tuple[tuple[Any, ...], dict[str, Any]], attrs: Mapping[str, tuple[int, int]], tp: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call production makes of a block: with the region's input width shown local
    where the plan says so (``INPUT_WIDTH``), as the boundary's forward does."""
    width = attrs.get(INPUT_WIDTH)
    if width is None:
        return call
    return present_local(call[0], dict(call[1]), width[0], tp)


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
    raise propose(
        FusedProjectionError(
            f"{fqn}: hp cannot prove how {type(block).__name__}'s forward splits its fused "
            f"projection {sorted(spec._fused_layouts)} on tp={tp}: {why}. Its local shards would "
            "compute a different program, so the plan is refused before any collective.\nFix: "
            "keep the block whole on tp (an override replicating its parameters, output "
            "replicated), or install a plugin template that declares the layout."
        ),
        keep_whole_proposal(fqn, spec, match=match or None),
    )


def _prove(
    model: nn.Module,
    fqn: str,
    spec: ModuleShardingSpec,
    mesh: MeshSpec,
    call: tuple[tuple[Any, ...], dict[str, Any]] | None,
    match: str = "",
) -> tuple[dict[str, dict[str, Any]], dict[str, tuple[int, int]]]:
    """The proven layouts of boundary ``fqn`` (see the module docstring) and the attributes
    the search found local beyond the known ones, or a refusal (whose override matches
    ``match``: every block like it)."""
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
        if not all(layout.units):  # no head count was read: the forward's views give it
            layout = _units_from_views(global_ops.get(path, []), layout)
            if not all(layout.units):
                raise propose(
                    FusedProjectionError(
                        f"{fqn}.{rel}: {type(block).__name__}: cannot read the head count and "
                        "head_dim of this fused q/k/v projection from the module, its config or "
                        "its forward (no view of each part into heads).\nFix: keep the boundary "
                        "whole on tp (an override replicating its parameters), or add a plugin "
                        "template for it."
                    ),
                    keep_whole_proposal(fqn, spec, match=match or None),
                )
        shape = tuple(block.get_parameter(rel).shape)
        try:
            layout.check("", shape, tp)
        except FusedProjectionError as e:
            raise propose(
                FusedProjectionError(f"{fqn}.{rel}: {str(e).lstrip(': ')}"),
                keep_whole_proposal(fqn, spec, match=match or None),
            ) from None
        proven[rel] = layout.to_data()
    spec.with_derived(fused_layouts=proven)
    attrs = compute_tp_local_attrs(model, fqn, spec, mesh) or {}
    paths = {p: p for p in owners}

    def attempt(trial: dict[str, tuple[int, int]]) -> bool:
        try:
            ops = _run(_local_clone(block, spec, tp, trial), paths, local_call(call, trial, tp))
        except Exception:  # this set does not even run: not the one
            return False
        return all(_compare(global_ops.get(p, []), ops.get(p, []), tp) is None for p in owners)

    if attempt(attrs):
        return proven, {}
    # The known names do not make the program local: find what does, and prove it.
    shown = head_search.shapes_shown(global_ops)
    width = input_width(block, spec)
    found = head_search.search_local_attrs(block, tp, shown, attrs, attempt, width=width)
    if found is not None:
        return proven, {a: v for a, v in found.items() if a not in attrs}
    try:
        local_ops = _run(_local_clone(block, spec, tp, attrs), paths, call)
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
    return proven, {}  # pragma: no cover - the known names failed, so the above refused


def record_found(
    spec: ModuleShardingSpec,
    found: Mapping[str, tuple[int, int]],
    base: Mapping[str, tuple[int, int]] | None = None,
) -> None:
    """Record the attributes the search proved local: in the spec's ``tp_divide_attrs`` (so
    a saved or frozen plan re-derives them) and its tp-local attribute plan."""
    declared = list(spec.tp_divide_attrs) if isinstance(spec.tp_divide_attrs, list) else []
    extra = [a for a in found if a not in (base or {}) and a not in declared]
    if extra:
        spec.tp_divide_attrs = [*declared, *extra]
    plan = dict(spec._tp_local_attr_plan or {})
    plan.update(found)
    spec.with_derived(tp_local_attr_plan=plan)


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
        layouts = {r: dict(d) for r, d in proven[keys[fqn]][0].items()}
        spec.with_derived(fused_layouts=layouts)
        if proven[keys[fqn]][1]:
            record_found(spec, proven[keys[fqn]][1])
        split = any(len(d["parts"]) > 1 for d in layouts.values())
        if split and spec.region_dispatch is None:
            # Re-arranged (read off the forward, or derived where the template could not
            # tell): the region runs on the local [Q_r; K_r; V_r], as a derived layout's does.
            spec.region_dispatch = False
        elif (
            spec.region_dispatch is False
            and moved
            and all(len(d["parts"]) == 1 for d in layouts.values())
        ):
            spec.region_dispatch = None
