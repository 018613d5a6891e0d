"""Gradient clipping by the global norm of a model parallelized by hp.

``torch.nn.utils.clip_grad_norm_`` on one rank sees only that rank's local tensors: a
shard of a tensor-parallel weight, a full copy of a replicated norm weight, a slice of a
slice under FSDP2. Summing every rank's local norm over the world counts each replicated
gradient once per copy (``tp`` times for a norm weight, ``dp`` times under DDP), so the
norm comes out too large and every step is clipped too hard. :func:`clip_grad_norm_`
counts every gradient value of the unsharded model exactly once.

The counting. For a finite ``p``::

    total ** p = sum over every rank of  sum over its parameters of  |local grad| ** p / r

where ``r`` is how many ranks of the world hold an identical copy of that local tensor.
A local tensor is identified by the chunk it holds along every dimension it is split on:

* a DTensor gradient (validate mode, FSDP2): each mesh dim on which it is ``Shard`` or
  ``_StridedShard`` (FSDP2's dp split of a dim hp split on tp);
* the plan's placement (production mode, and under FSDP2 the plan's axes that the
  gradient's own mesh does not name): each plan axis with a ``Shard`` placement, on the
  plan's mesh, or for expert parameters (``spec._ep_size > 1``, placed on ``ep``) on the
  derived ``(edp, ep)`` expert mesh.

Every other axis holds copies: the tp ranks of a replicated weight (hp sums its partial
gradients over tp, sequence parallelism included, and over cp, at the end of backward),
the ``dp`` ranks under DDP (which averages them), expert replicas on ``edp``, and ranks
outside the plan's mesh when it is a sub-mesh of the world. ``r`` is counted, not
assumed: each rank's chunk coordinates are gathered once per layout (then cached), and
``r`` is the number of ranks with the same coordinates. One ``all_reduce`` (SUM; MAX
for ``norm_type=inf``, where copies do not matter) of one scalar over the default
process group then gives every rank the same total.

This assumes every rank of the default group holds a shard or a copy of the same model,
with data-parallel replicas already synchronized (DDP, FSDP2); pipeline stages are not
supported.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hp_core.errors import HpError
from hp_core.runtime.applied import applied_module, finalize_grads
from hp_core.runtime.partial import is_expert_param
from hp_core.spec.module_spec import layout_map

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "GradLayoutMismatchError",
    "GradNormTypeError",
    "NonFiniteGradNormError",
    "NotAppliedError",
    "clip_grad_norm_",
]


class NotAppliedError(HpError, TypeError):
    """``hp_core.clip_grad_norm_`` got a model that ``hp_core.apply`` did not parallelize."""


class GradNormTypeError(HpError, ValueError):
    """A ``norm_type`` that is neither a positive number nor ``inf``."""


class GradLayoutMismatchError(HpError, RuntimeError):
    """The ranks hold different sets of gradient layouts (not one model, sharded and copied)."""


class NonFiniteGradNormError(HpError, RuntimeError):
    """The total gradient norm is NaN or infinite and ``error_if_nonfinite=True``."""


#: model → {layout signature → ranks holding each layout's copy}: counted once per layout.
_REPLICAS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], tuple[int, ...]]] = (
    weakref.WeakKeyDictionary()
)

#: One split of a local tensor: (mesh, mesh dim).
_Split = tuple[Any, int]


def _not_applied(model: nn.Module) -> NotAppliedError:
    return NotAppliedError(
        f"hp_core.clip_grad_norm_: {type(model).__name__} was not parallelized by hp "
        "(it has no _hp_applied; apply() sets it on the module it is given). The norm of "
        "a sharded model needs hp's layouts to count each gradient value once. Call "
        "hp_core.clip_grad_norm_ with the module you passed to hp_core.apply (DDP and "
        "torch.compile wrappers of it are fine), or, for a model hp did not apply, use "
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)."
    )


def _norm_type(norm_type: float) -> float:
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        p = math.nan
    if not (p > 0):  # also NaN
        raise GradNormTypeError(
            f"hp_core.clip_grad_norm_: norm_type={norm_type!r}: the norm must be a positive "
            "number or inf (2.0 is the usual one, float('inf') the largest |gradient|)."
        )
    return p


def _declared(model: nn.Module, state: Any) -> dict[int, tuple[Any, dict[str, Any]]]:
    """``id(parameter) → (mesh, {axis: placement})`` from the plan, resolved now.

    Parameters are looked up by (owning module, attribute) at call time, so objects that
    FSDP2 swapped in after ``apply`` are the ones found.
    """
    out: dict[int, tuple[Any, dict[str, Any]]] = {}
    for fqn, spec in state.plan.items():
        try:
            module = model.get_submodule(fqn) if fqn else model
        except AttributeError:
            continue
        for rel, named in layout_map(spec.params).items():
            path, _, attr = rel.rpartition(".")
            try:
                owner = module.get_submodule(path) if path else module
            except AttributeError:
                continue  # e.g. per-expert sources that stacking replaced
            p = owner._parameters.get(attr)
            if p is None:
                continue
            if is_expert_param(spec, named):
                emesh = state.expert_meshes.get(spec._ep_size)
                if emesh is not None:
                    out[id(p)] = (emesh, {"ep": named["ep"]})
            else:
                out[id(p)] = (state.mesh, dict(named))
    return out


def _parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """Every parameter that takes a gradient, once (tied parameters are one object)."""
    # model.parameters() yields a tied parameter once already.
    yield from (p for p in model.parameters() if p.requires_grad)


def _splits(p: nn.Parameter, declared: dict[int, tuple[Any, dict[str, Any]]]) -> list[_Split]:
    """The dims along which this rank's local gradient of ``p`` is one chunk of several."""
    t = p.grad if p.grad is not None else p
    splits: list[_Split] = []
    named_by_grad: set[str] = set()
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        # FSDP2's dp split of a dim hp already split on tp is a _StridedShard (validate
        # mode), which is not a Shard subclass: a split all the same.
        splits += [
            (mesh, i) for i, pl in enumerate(t.placements) if isinstance(pl, Shard | _StridedShard)
        ]
        named_by_grad = set(mesh.mesh_dim_names or ())
    if id(p) in declared:
        mesh, named = declared[id(p)]
        names = list(mesh.mesh_dim_names or ())
        for axis, pl in named.items():
            if isinstance(pl, Shard) and axis in names and axis not in named_by_grad:
                splits.append((mesh, names.index(axis)))
    return [(m, d) for m, d in splits if m.size(d) > 1]


def _mesh_key(mesh: DeviceMesh, cache: dict[int, tuple[Any, ...]]) -> tuple[Any, ...]:
    """What identifies a mesh's rank layout on this rank (equal meshes share layouts)."""
    key = cache.get(id(mesh))
    if key is None:
        ranks = tuple(mesh.mesh.flatten().tolist())
        key = (tuple(mesh.mesh_dim_names or ()), tuple(mesh.shape), ranks)
        cache[id(mesh)] = key
    return key


def _local(g: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds; a Partial DTensor gradient is summed first (a copy)."""
    if not isinstance(g, DTensor):
        return g
    if any(isinstance(pl, Partial) for pl in g.placements):
        whole = [Replicate() if isinstance(pl, Partial) else pl for pl in g.placements]
        return g.redistribute(g.device_mesh, whole).to_local()
    return g._local_tensor


class _Layouts:
    """The local gradients of a model, grouped by layout (how they are split over ranks).

    ``codes[c]`` is this rank's chunk index along layout ``c``'s splits (mixed radix);
    ranks with equal codes hold copies of one chunk. ``key`` is identical on every rank
    that sees the same layouts, so the replica counts can be cached by it.
    """

    def __init__(self, model: nn.Module, state: Any) -> None:
        declared = _declared(model, state)
        meshes: dict[int, tuple[Any, ...]] = {}
        index: dict[tuple[Any, ...], int] = {}
        self.params = list(_parameters(model))
        self.codes: list[int] = []
        self.grads: list[tuple[torch.Tensor, int]] = []  # (local gradient, layout)
        for p in self.params:
            splits = _splits(p, declared)
            sig = tuple((_mesh_key(m, meshes), d) for m, d in splits)
            if sig not in index:
                index[sig] = len(index)
                code = 0
                for m, d in splits:
                    code = code * m.size(d) + m.get_local_rank(d)
                self.codes.append(code)
            if p.grad is not None:
                self.grads.append((_local(p.grad), index[sig]))
        self.key = tuple(index)

    def device(self) -> torch.device:
        for p in self.params:
            t = p.grad if p.grad is not None else p
            local = t._local_tensor if isinstance(t, DTensor) else t
            if local.device.type != "meta":
                return local.device
        if "nccl" in str(dist.get_backend()):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def dtype(self) -> torch.dtype:
        """What torch's clip_grad_norm_ returns its norm in: the gradients' common dtype."""
        dtypes = [g.dtype for g, _ in self.grads]
        return functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32


def _count_replicas(codes: list[int], device: torch.device) -> tuple[int, ...]:
    """For each layout, how many ranks of the world hold the same chunk as this one."""
    n = torch.tensor([len(codes)], dtype=torch.int64, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    mine = torch.full((int(n.item()) + 1,), -1, dtype=torch.int64, device=device)
    mine[0] = len(codes)
    mine[1 : len(codes) + 1] = torch.tensor(codes, dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    table = torch.stack(parts).cpu()
    if bool((table[:, 0] != len(codes)).any()):
        raise GradLayoutMismatchError(
            "hp_core.clip_grad_norm_: the ranks see different gradient layouts "
            f"({table[:, 0].tolist()} layouts per rank): every rank of the default process "
            "group must hold a shard or a copy of the same model, with the same parameters "
            "taking gradients."
        )
    return tuple(int((table[:, 1 + c] == codes[c]).sum()) for c in range(len(codes)))


def _total_norm(model: nn.Module, layouts: _Layouts, p: float) -> torch.Tensor:
    """The global norm: each chunk's ``|g|^p`` divided by its copies, summed over the world."""
    device = layouts.device()
    acc = torch.float64 if layouts.dtype() == torch.float64 else torch.float32
    grads = [(g, c) for g, c in layouts.grads if g.numel()]
    if math.isinf(p):  # copies do not change a maximum
        local = torch.zeros((), dtype=acc, device=device)
        for g, _ in grads:
            local = torch.maximum(local, torch.linalg.vector_norm(g, p, dtype=acc).to(device))
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return local
    cached = _REPLICAS.setdefault(model, {})
    replicas = cached.get(layouts.key)
    if replicas is None:
        replicas = cached[layouts.key] = _count_replicas(layouts.codes, device)
    per_layout = [torch.zeros((), dtype=acc, device=device) for _ in layouts.codes]
    for g, c in grads:
        per_layout[c] += torch.linalg.vector_norm(g, p, dtype=acc).to(device) ** p
    local = torch.zeros((), dtype=acc, device=device)
    for c, s in enumerate(per_layout):
        local += s / replicas[c]
    dist.all_reduce(local, op=dist.ReduceOp.SUM)
    return local ** (1.0 / p)


def clip_grad_norm_(
    model: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the gradients of an hp-parallelized model by their global norm, in place.

    The same as ``torch.nn.utils.clip_grad_norm_(single_device_model.parameters(), ...)``:
    returns the total ``norm_type``-norm of every gradient of the unsharded model (a
    0-dim tensor, equal on every rank) and multiplies every gradient by
    ``min(1, max_norm / (total + 1e-6))``. ``model`` is the module given to
    ``hp_core.apply`` (or a DDP / ``torch.compile`` wrapper of it), possibly wrapped
    with FSDP2 afterwards; every rank of the default process group must call it.
    Each replicated gradient value is counted once, each shard once (see the module
    docstring). Pending hp gradient reductions are flushed first.
    """
    p = _norm_type(norm_type)
    root = applied_module(model)
    state = root.__dict__.get("_hp_applied")
    if state is None:
        raise _not_applied(model)
    finalize_grads(root)
    layouts = _Layouts(root, state)
    total = _total_norm(root, layouts, p).to(layouts.dtype())
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise NonFiniteGradNormError(
            f"The total norm of order {p} for gradients from `model` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for param in layouts.params:
        g = param.grad
        if g is not None:
            local = g._local_tensor if isinstance(g, DTensor) else g
            groups.setdefault((local.device, local.dtype), []).append(local)
    for (device, _dtype), tensors in groups.items():
        torch._foreach_mul_(tensors, coef.to(device))
    return total
