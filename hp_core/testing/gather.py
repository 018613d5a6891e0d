"""Gather a parallel model's gradients back whole, without hp's own tables.

:func:`gather_full_grads` infers every layout from the local shape and the single-device
reference's shape (or from the DTensor itself), gathers FSDP2's data-parallel shards back,
checks that replicated gradients are the same on every rank, and refuses unreduced
(``Partial``) gradients. A layout bug in hp's runtime then shows up as a mismatch instead
of being gathered with the same wrong table.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from hp_core.mesh import is_data_axis

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

#: What ``expert_groups`` takes: one process group or expert mesh, or several (a list, or a
#: mapping's values).
ExpertGroups: TypeAlias = (
    "ProcessGroup | DeviceMesh | list[ProcessGroup | DeviceMesh]"
    " | tuple[ProcessGroup | DeviceMesh, ...] | Mapping[Any, ProcessGroup | DeviceMesh]"
)

__all__ = [
    "DEFAULT_EXPERT_PARAMS",
    "REPLICA_TOL",
    "GradientCheckError",
    "gather_full_grads",
    "is_data_axis",
]

#: Replica check tolerance of :func:`gather_full_grads`: copies of one replicated gradient
#: on different ranks may differ by at most ``REPLICA_TOL * (1 + |g|)`` element-wise.
REPLICA_TOL = 1e-6

#: Which parameter names :func:`gather_full_grads` treats as expert parameters (a path
#: component ``experts``: HF's ``mlp.experts.gate_up_proj``, hp's ``experts.w1.weight``).
DEFAULT_EXPERT_PARAMS = r"(^|\.)experts\."


class GradientCheckError(AssertionError):
    """A parallel gradient that cannot be gathered or is wrong before any comparison.

    Raised by :func:`gather_full_grads` on every rank of the mesh, with one line per problem
    (each naming the parameter): an unreduced ``Partial`` gradient, replicas that differ
    across ranks, a local shape that matches no layout, a name the reference lacks.
    """


def _axis_names(mesh: DeviceMesh) -> list[str]:
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("gather_full_grads needs a DeviceMesh with mesh_dim_names")
    return list(names)


def _mesh_all_gather_object(obj: Any, mesh: DeviceMesh) -> list[Any]:
    """``obj`` of every rank of ``mesh`` (gathered axis by axis), the same list on every rank."""
    values = [obj]
    for axis in _axis_names(mesh):
        gathered: list[Any] = [None] * mesh.size(_axis_names(mesh).index(axis))
        dist.all_gather_object(gathered, values, group=mesh.get_group(axis))
        values = [v for part in gathered for v in part]
    return values


def _all_gather(t: torch.Tensor, group: ProcessGroup) -> list[torch.Tensor]:
    t = t.detach().contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return parts


def _expert_groups(
    expert_groups: ExpertGroups | None,
) -> list[tuple[ProcessGroup, int, tuple[int, ...]]]:
    """``(group, size, global ranks)`` of each expert group the caller gave."""
    if expert_groups is None:
        return []
    if isinstance(expert_groups, Mapping):
        items = list(expert_groups.values())
    elif isinstance(expert_groups, (list, tuple)):
        items = list(expert_groups)
    else:
        items = [expert_groups]
    out = []
    for item in items:
        if isinstance(item, dist.ProcessGroup):
            group = item
        elif "ep" in (item.mesh_dim_names or ()):
            group = item.get_group("ep")
        elif item.ndim == 1:
            group = item.get_group()
        else:
            raise ValueError(
                f"expert group {item!r}: a DeviceMesh needs an 'ep' dim or exactly one dim"
            )
        ranks = tuple(dist.get_process_group_ranks(group))
        out.append((group, len(ranks), ranks))
    return out


def _reference_shapes(reference: nn.Module | Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    if isinstance(reference, nn.Module):
        return {n: tuple(p.shape) for n, p in reference.named_parameters()}
    return {
        n: tuple(v) if isinstance(v, (tuple, list)) else tuple(v.shape)
        for n, v in reference.items()
    }


def _local_meta(name: str, p: torch.Tensor) -> dict[str, Any]:
    """What this rank knows about one parameter's gradient (picklable)."""
    g = p.grad
    if g is None:  # callers pass only parameters with a gradient
        raise GradientCheckError(f"{name}: has no gradient to describe")
    meta: dict[str, Any] = {"dtensor": isinstance(p, DTensor)}
    if isinstance(p, DTensor):
        meta["param_placements"] = tuple(p.placements)
        meta["grad_dtensor"] = isinstance(g, DTensor)
        if isinstance(g, DTensor):
            meta["grad_placements"] = tuple(g.placements)
            meta["same_mesh"] = g.device_mesh == p.device_mesh
            meta["shape"] = tuple(g.shape)
    else:
        meta["grad_dtensor"] = isinstance(g, DTensor)
        meta["shape"] = tuple(g.shape)
    return meta


def _dtensor_problem(
    name: str, meta: dict[str, Any], full: tuple[int, ...], strict: bool
) -> str | None:
    if not meta["grad_dtensor"]:
        return f"{name}: the parameter is a DTensor but its gradient is a plain tensor"
    if not meta["same_mesh"]:
        return f"{name}: the gradient lives on another mesh than the parameter"
    pp, gp = meta["param_placements"], meta["grad_placements"]
    pairs = list(zip(gp, pp, strict=True))
    if any(isinstance(g, Partial) and not isinstance(q, Partial) for g, q in pairs):
        return (
            f"{name}: unreduced gradient: its placements {list(gp)} are Partial where the "
            f"parameter's {list(pp)} are not (nobody summed it)"
        )
    # A Replicate gradient of a Shard parameter is whole, just more than the parameter
    # needs (the replica check below still checks its copies agree): tolerated unless strict.
    tolerated = [
        g == q or (not strict and isinstance(g, Replicate) and isinstance(q, Shard))
        for g, q in pairs
    ]
    if not all(tolerated):
        return f"{name}: gradient placements {list(gp)} differ from the parameter's {list(pp)}"
    if meta["shape"] != full:
        return f"{name}: global shape {list(meta['shape'])} != the reference's {list(full)}"
    return None


def _local_layout(
    name: str,
    local: tuple[int, ...],
    full: tuple[int, ...],
    dense: list[tuple[str, int]],
    experts: list[tuple[Any, int, tuple[int, ...]]],
    is_expert: bool,
) -> tuple[str, Any, int] | str:
    """The layout of one local gradient, or the problem with it (a string).

    Layouts: ``("replicated", None, -1)``, ``("axis", name, dim)``, ``("expert", group, 0)``.
    """
    shapes = f"local shape {list(local)} vs the reference's {list(full)}"
    if len(local) != len(full):
        return f"{name}: {shapes}: the numbers of dims differ"
    dims = [d for d, (lo, fu) in enumerate(zip(local, full, strict=True)) if lo != fu]
    if not dims:
        return ("replicated", None, -1)
    if len(dims) > 1:
        return f"{name}: {shapes}: dims {dims} differ (at most one sharded dim is understood)"
    d = dims[0]
    if local[d] == 0 or full[d] % local[d]:
        return f"{name}: {shapes}: dim {d} is no even split of the full size"
    k = full[d] // local[d]
    if is_expert and d == 0:
        matching = {ranks: group for group, size, ranks in experts if size == k}
        if len(matching) == 1:
            return ("expert", next(iter(matching.values())), 0)
        if len(matching) > 1:
            return f"{name}: {shapes}: {len(matching)} different expert groups of size {k}"
    order = [a for a in dense if a[0] == "tp"] + [a for a in dense if a[0] != "tp"]
    for axis, size in order:
        if size == k:
            return ("axis", axis, d)
    sizes = {a: s for a, s in dense}
    return (
        f"{name}: {shapes}: dim {d} is split {k} ways, which matches no mesh axis "
        f"(non-data axes {sizes}) nor expert group (sizes {[s for _, s, _ in experts]})"
    )


def _replica_problem(
    name: str, full: torch.Tensor, axis: str, mesh: DeviceMesh, tol: float, stats: dict | None
) -> str | None:
    """Check ``full`` is the same on every rank of ``axis`` (collective over that axis)."""
    parts = _all_gather(full, mesh.get_group(axis))
    ref = parts[0].double()
    worst = 0.0
    ok = True
    for part in parts[1:]:
        x = part.double()
        same_nan = torch.isnan(x) & torch.isnan(ref)
        delta = torch.where(same_nan, torch.zeros_like(x), (x - ref).abs())
        delta = torch.nan_to_num(delta, nan=math.inf)
        both_inf = torch.isinf(x) & (x == ref)
        delta = torch.where(both_inf, torch.zeros_like(delta), delta)
        if delta.numel():
            worst = max(worst, float(delta.max()))
            scale = 1.0 + ref.abs().nan_to_num(nan=0.0, posinf=0.0)
            ok = ok and bool((delta <= tol * scale).all())
    if stats is not None:
        stats[name] = max(stats.get(name, 0.0), worst)
    if ok:
        return None
    ranks = dist.get_process_group_ranks(mesh.get_group(axis))
    return (
        f"{name}: replicas differ across mesh axis {axis!r} (global ranks {ranks}): "
        f"max |difference| between ranks = {worst:.6g} (tolerance {tol:g} * (1 + |g|)); "
        f"a missed gradient reduction?"
    )


def _unshard_data_parallel(p: torch.Tensor) -> torch.Tensor:
    """A parameter that FSDP2 sharded over data-parallel axes, gathered back over them.

    FSDP2 turns each parameter into a DTensor on its ``dp`` mesh, sharded there; what is
    left is the tensor hp placed (a plain local shard, in production mode). Collective over
    the data-parallel group; every rank reaches it for the same parameters in order.
    """
    if not isinstance(p, DTensor) or not all(
        is_data_axis(a) for a in (p.device_mesh.mesh_dim_names or ("?",))
    ):
        return p
    q = nn.Parameter(p.full_tensor().detach(), requires_grad=p.requires_grad)
    grad = p.grad
    q.grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return q


def gather_full_grads(
    model: nn.Module,
    reference: nn.Module | Mapping[str, Any],
    mesh: DeviceMesh,
    *,
    expert_groups: ExpertGroups | None = None,
    expert_params: str | Callable[[str], bool] = DEFAULT_EXPERT_PARAMS,
    replica_axes: Iterable[str] | None = None,
    replica_tol: float = REPLICA_TOL,
    strict_placements: bool = False,
    stats: dict[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """Every parameter gradient of a parallel model, unsharded, checked, without hp's tables.

    Collective over every rank of ``mesh``: call it on all of them. For each named
    parameter of ``model`` with a gradient, matched by name to ``reference`` (the
    single-device model, or a mapping of names to full tensors or shapes, e.g. with
    per-expert parameters stacked under the parallel model's names):

    * a parameter FSDP2 sharded over a data-parallel mesh is first gathered back over it;
    * DTensor parameter (validate mode): the gradient must be a DTensor on the same mesh
      with the parameter's placements; then ``full_tensor()``. A ``Partial`` gradient of
      a non-partial parameter is an unreduced gradient: an error. A ``Replicate`` gradient
      where the parameter is ``Shard`` is whole (and replica-checked below), so it is
      accepted unless ``strict_placements`` (hp's validate mode leaves the vocab-parallel
      embedding's gradient so).
    * plain tensor (production mode): the layout is inferred from the local shape and the
      reference's full shape. Equal shapes: replicated. Exactly one dim ``d`` smaller by
      a factor ``k``: contiguous chunks along ``d`` over a mesh axis of size ``k`` (``tp``
      tried first, then the others in mesh order, never a data axis ``dp*``), gathered
      in rank order. Parameters whose name matches ``expert_params`` and whose dim 0 is
      ``E / k`` are gathered over the expert group of size ``k`` in ``expert_groups`` (a
      ``ProcessGroup``, a DeviceMesh with an ``ep`` dim or one dim, or a mapping/list of
      them, e.g. ``model._hp_applied.expert_meshes``).
    * replica check: the full gradient must then be the same on every rank of every
      ``replica_axes`` axis (default: every non-data axis of ``mesh``) it was not gathered
      over, element-wise within ``replica_tol * (1 + |g|)`` (0.0 demands bit-identity;
      NaNs at the same places count as equal). ``stats``, if given, receives each
      parameter's largest difference between ranks.

    Every problem (each naming the parameter and, for layouts, both shapes) is collected
    and a :class:`GradientCheckError` listing them all is raised on every rank; all ranks
    take the same collective path whatever they find, so no problem can deadlock.
    """
    axes = _axis_names(mesh)
    sizes = dict(zip(axes, mesh.shape, strict=True))
    if replica_axes is None:
        check_axes = [a for a in axes if not is_data_axis(a)]
    else:
        check_axes = list(replica_axes)
        unknown = sorted(set(check_axes) - set(axes))
        if unknown:
            raise ValueError(f"replica_axes {unknown} are not axes of the mesh {axes}")
    dense = [(a, sizes[a]) for a in axes if not is_data_axis(a)]
    experts = _expert_groups(expert_groups)
    selector = expert_params
    is_expert: Callable[[str], bool] = (
        (lambda n: re.search(selector, n) is not None) if isinstance(selector, str) else selector
    )
    full_shapes = _reference_shapes(reference)

    params = {
        n: _unshard_data_parallel(p) for n, p in model.named_parameters() if p.grad is not None
    }
    metas = _mesh_all_gather_object(
        (dist.get_rank(), {n: _local_meta(n, p) for n, p in params.items()}), mesh
    )
    metas.sort(key=lambda rm: rm[0])
    problems: list[str] = []
    names = list(metas[0][1])
    everywhere = set(names)
    for rank, m in metas:
        if set(m) != everywhere:
            odd = sorted(set(m) ^ everywhere)
            problems.append(f"rank {rank} has gradients for another set of parameters: {odd[:8]}")
        everywhere &= set(m)
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name not in everywhere:
            continue
        per_rank = {rank: m[name] for rank, m in metas}
        if name not in full_shapes:
            problems.append(f"{name}: not a parameter of the reference")
            continue
        full_shape = full_shapes[name]
        kinds = {(meta["dtensor"], meta["grad_dtensor"]) for meta in per_rank.values()}
        if len(kinds) > 1:
            problems.append(f"{name}: DTensor on some ranks, a plain tensor on others")
            continue
        first = per_rank[metas[0][0]]
        gathered_axes: set[str] = set()
        if first["dtensor"]:
            found = {
                _dtensor_problem(name, meta, full_shape, strict_placements)
                for meta in per_rank.values()
            }
            found.discard(None)
            if found:
                problems.extend(sorted(str(f) for f in found))
                continue
            grad = params[name].grad
            if not isinstance(grad, DTensor):
                problems.append(
                    f"{name}: a DTensor parameter whose gradient is {type(grad).__name__}"
                )
                continue
            full = grad.full_tensor()
            if grad.device_mesh == mesh:  # full_tensor() gathered its Shard axes: equal there
                gathered_axes = {
                    axes[i] for i, q in enumerate(grad.placements) if isinstance(q, Shard)
                }
        elif first["grad_dtensor"]:
            problems.append(f"{name}: a plain parameter with a DTensor gradient")
            continue
        else:
            shapes = {meta["shape"] for meta in per_rank.values()}
            if len(shapes) > 1:
                by_rank = {r: list(meta["shape"]) for r, meta in per_rank.items()}
                problems.append(f"{name}: local shapes differ across ranks {by_rank}")
                continue
            layout = _local_layout(
                name, next(iter(shapes)), full_shape, dense, experts, is_expert(name)
            )
            if isinstance(layout, str):
                problems.append(layout)
                continue
            kind, where, dim = layout
            grad = params[name].grad
            if grad is None:
                problems.append(f"{name}: no gradient on this rank")
                continue
            local = grad.detach()
            if kind == "replicated":
                full = local
            else:
                group = mesh.get_group(where) if kind == "axis" else where
                full = torch.cat(_all_gather(local, group), dim=dim)
                gathered_axes = {where} if kind == "axis" else set()
        for axis in check_axes:
            if axis not in gathered_axes and sizes.get(axis, 1) > 1:
                found_r = _replica_problem(name, full, axis, mesh, replica_tol, stats)
                if found_r is not None:
                    problems.append(found_r)
        out[name] = full
    every = _mesh_all_gather_object(problems, mesh)
    unique = list(dict.fromkeys(p for part in every for p in part))
    if unique:
        raise GradientCheckError(
            f"{len(unique)} gradient problem(s):\n" + "\n".join(f"  {p}" for p in unique)
        )
    return out
