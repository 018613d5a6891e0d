"""Which collectives a plan implies: per boundary transition, per plugin call, per step.

The rules per layout change are the one table of :mod:`hp_core.collectives`
(``TRANSITIONS``), which production's lowering runs too. This module applies them to a
plan's boundaries, adds what the registry items a plan names (inner wrappers, compute
factories) declare they issue per call, and the per-step extras (the input guard, the
vocab-parallel loss, the bucketed gradient reductions): the prediction ``hp plan`` and
``explain()`` print, and the tests compare with what runs.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from torch.distributed.tensor import Placement, Replicate, Shard

from hp_core.collectives import Collective, Transition, grad_is_partial, transition
from hp_core.injection import Target
from hp_core.mesh import is_data_axis
from hp_core.plugins import PluginRegistry, RegistryKind
from hp_core.spec.module_spec import ModuleShardingSpec

__all__ = [
    "boundary_collectives",
    "boundary_transitions",
    "input_check_axes",
    "plugin_collectives",
    "reduction_axes",
    "sp_grad_params",
    "step_collectives",
]


def _pairs(
    src: Mapping[str, Mapping[str, Placement]] | str | None,
    dst: Mapping[str, Mapping[str, Placement]] | str | None,
):
    src = src if isinstance(src, dict) else {}
    dst = dst if isinstance(dst, dict) else {}
    for name in src:
        if name in dst:
            axes = list(dict.fromkeys([*src[name], *dst[name]]))
            for axis in axes:
                yield name, axis, src[name].get(axis, Replicate()), dst[name].get(axis, Replicate())


def boundary_transitions(fqn: str, spec: ModuleShardingSpec) -> list[Transition]:
    """Every entry (``in_src → in_dst``) and exit (``out_src → out_dst``) transition, per axis.

    Unchanged layouts are listed too (their forward is None; a replicated input of a
    boundary that shards parameters still all-reduces its gradient). A non-boundary
    (``is_boundary=False``) has none.
    """
    out: list[Transition] = []
    if not spec.is_boundary:
        return out
    for name, axis, s, d in _pairs(spec.in_src, spec.in_dst):
        fwd, bwd = transition(s, d, grad_partial=grad_is_partial(spec, axis))
        out.append(Transition(fqn, "in", name, axis, s, d, fwd, bwd))
    for name, axis, s, d in _pairs(spec.out_src, spec.out_dst):
        fwd, bwd = transition(s, d, grad_partial=False)
        out.append(Transition(fqn, "out", name, axis, s, d, fwd, bwd))
    return out


def boundary_collectives(fqn: str, spec: ModuleShardingSpec) -> list[Collective]:
    """The collectives of one boundary's entry and exit transitions."""
    out: list[Collective] = []
    for t in boundary_transitions(fqn, spec):
        if t.forward:
            out.append(Collective(t.forward, t.axis, "forward", f"{fqn} {t.side}.{t.name}"))
        if t.backward:
            out.append(Collective(t.backward, t.axis, "backward", f"{fqn} {t.side}.{t.name}"))
    return out


def _registry_name(injection: Any) -> tuple[str | None, Mapping[str, Any]]:
    """The registry name and config an injection names (None: a callable or an import path)."""
    if isinstance(injection, Target):
        return (None if injection.is_path else injection.target), injection.config
    if isinstance(injection, str) and "." not in injection and ":" not in injection:
        return injection, {}
    return None, {}


def plugin_collectives(
    fqn: str, spec: ModuleShardingSpec, sizes: Mapping[str, int]
) -> list[Collective]:
    """What the registry items a boundary names (inner wrapper, compute factory) issue per call.

    Each item declares its collectives at registration (``collectives=``, a callable of the
    mesh axis sizes and the item's config); an item that declares nothing, a callable and
    an import path add none. ``sizes`` gains ``ep`` where the boundary is expert-parallel.
    """
    if not spec.is_boundary:
        return []
    axis_sizes = dict(sizes)
    if spec._ep_size > 1:
        axis_sizes["ep"] = spec._ep_size
    out: list[Collective] = []
    for kind, injection in (
        (RegistryKind.INNER_WRAPPER, spec.inner_wrapper),
        (RegistryKind.COMPUTE_FACTORY, spec.local_compute_fn),
    ):
        name, config = _registry_name(injection)
        item = PluginRegistry(kind).get(name) if name is not None else None
        declare = getattr(item, "collectives", None)
        if declare is None:
            continue
        for c in declare(axis_sizes, dict(config)):
            out.append(dataclasses.replace(c, where=f"{fqn} {kind.label} {name!r}: {c.where}"))
    return out


def sp_grad_params(modules: Mapping[str, ModuleShardingSpec]) -> list[str]:
    """Parameters replicated on tp inside boundaries that compute on tp-sequence-sharded inputs.

    Each rank sees only its tokens, so their gradients are partial sums; hp reduces them
    once per step, all together. Deferred rowwise biases count too when their boundary
    exits tp-sharded: they are added after the reduce-scatter, to this rank's tokens only
    (Megatron marks them ``sequence_parallel`` for the same reason).
    """
    out = []
    for fqn, spec in modules.items():
        if not spec.is_boundary or not isinstance(spec.params, dict) or not spec.params:
            continue
        in_dst = spec.in_dst if isinstance(spec.in_dst, dict) else {}
        out_dst = spec.out_dst if isinstance(spec.out_dst, dict) else {}
        sharded_in = any(isinstance(layout.get("tp"), Shard) for layout in in_dst.values())
        sharded_out = any(isinstance(layout.get("tp"), Shard) for layout in out_dst.values())
        deferred = set(spec._deferred_bias_params) if sharded_out else set()
        if not sharded_in and not deferred:
            continue
        for rel, named in spec.params.items():
            if not isinstance(named.get("tp", Replicate()), Replicate) or "ep" in named:
                continue
            if sharded_in or rel in deferred:
                out.append(f"{fqn}.{rel}" if fqn else rel)
    return out


def reduction_axes(
    modules: Mapping[str, ModuleShardingSpec], reductions: Iterable[Any] | None = None
) -> list[str]:
    """The axes over which hp sums partial gradients once per step.

    With ``reductions`` (a verifier report's, ``VerifyReport.reductions``) this is exact.
    Without, it is the contract's prediction: an axis along which some boundary's data is
    sharded while one of its parameters is replicated (which misses gradients that are
    partial only because of what happens inside a region — the verifier finds those).
    """
    if reductions is not None:
        return list(dict.fromkeys(a for r in reductions for a in r.axes))
    axes: list[str] = ["tp"] if sp_grad_params(modules) else []
    for spec in modules.values():
        if not spec.is_boundary or not isinstance(spec.params, dict) or not spec.params:
            continue
        in_dst = spec.in_dst if isinstance(spec.in_dst, dict) else {}
        for layout in in_dst.values():
            for axis, p in layout.items():
                replicated = any(
                    isinstance(named.get(axis, Replicate()), Replicate) and "ep" not in named
                    for named in spec.params.values()
                )
                if (
                    isinstance(p, Shard)
                    and replicated
                    and axis not in axes
                    and not is_data_axis(axis)
                ):
                    axes.append(str(axis))
    return axes


def input_check_axes(axis_names: Iterable[str], sizes: Iterable[int]) -> list[str]:
    """The axes the input guard compares a forward's inputs over (non-dp axes of size > 1)."""
    return [
        str(a) for a, n in zip(axis_names, sizes, strict=True) if int(n) > 1 and not is_data_axis(a)
    ]


def step_collectives(
    modules: Mapping[str, ModuleShardingSpec],
    *,
    loss_parallel: bool = False,
    reductions: Iterable[Any] | None = None,
    check_axes: Iterable[str] = (),
    sizes: Mapping[str, int] | None = None,
) -> Counter[tuple[str, str, str]]:
    """``{(phase, op, axis): count}`` for one forward + backward of the whole plan.

    ``loss_parallel`` adds the vocab-parallel cross-entropy's two forward all-reduces
    (the max, then the sum of exponentials packed with the target logit). The gradient
    reductions count one all-reduce per axis (:func:`reduction_axes`); the input guard one
    small forward all-reduce per axis of ``check_axes`` (:func:`input_check_axes`). With
    the mesh's axis ``sizes``, the plugin items' declared collectives count too
    (:func:`plugin_collectives`); without, only the plan's own boundaries do.
    """
    counts: Counter[tuple[str, str, str]] = Counter()
    for axis in check_axes:
        counts[("forward", "all_reduce", axis)] += 1
    if loss_parallel:
        counts[("forward", "all_reduce", "tp")] += 2
    for fqn, spec in modules.items():
        for c in boundary_collectives(fqn, spec):
            counts[(c.phase, c.op, c.axis)] += 1
        for c in plugin_collectives(fqn, spec, sizes) if sizes is not None else ():
            counts[(c.phase, c.op, c.axis)] += 1
    for axis in reduction_axes(modules, reductions):
        counts[("backward", "all_reduce", axis)] += 1  # one bucketed reduction per step
    return counts
