"""The local-program gate: a tp-sharded attention block must run the global program, scaled.

Validate mode runs each block on DTensors of the global shapes, so a forward that reads a
head count the plan did not make local (``self.heads``, a constant, a shared config value)
computes the global program there and matches, while production runs the same forward on
local shards and silently computes another one (each head ``head_dim / tp`` wide). Only the
production program shows that, so it is checked here, at plan time, on the meta device.

Each distinct attention block whose projections are column-sharded on tp is traced twice
with :mod:`hp_core.planner.fused_proof`'s recorder: the global program, and the local one
production runs (local parameter shapes, the plan's tp-local attributes). The shape-
changing ops on what derives from each column-sharded projection must be the same ops, with
exactly one dim divided by tp and never a per-head width. When the known head-count names
do not make it so, :mod:`hp_core.planner.head_search` finds the values that do (the block's
and its config's integer attributes, the input's width) and records them. Otherwise the
plan is refused, naming the op and both shapes, before any collective. A local program that
fails outright is loud, not silent: the verifier's meta run of production refuses it at
apply (ProductionDiffersError), so it is left to that. A block whose forward is replaced by
an inner wrapper or a compute (CP attention, BLOOM's ALiBi rows, experts) is its wrapper's
contract and is not traced; a block the model's forward does not reach on meta is left to
the verifier, as before.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.tensor import Shard

from hp_core.mesh import MeshSpec
from hp_core.planner import head_search
from hp_core.planner.fused_proof import (
    _capture,
    _clone,
    _compare,
    _key,
    _local_clone,
    _run,
    local_call,
    record_found,
)
from hp_core.planner.lints import PlanningError, input_width, is_conv1d
from hp_core.plans.example import ExampleCall
from hp_core.plans.fixes import keep_whole_proposal
from hp_core.plans.proposal import propose
from hp_core.spec.module_spec import ModuleShardingSpec

__all__ = ["LocalProgramError", "prove_local_programs"]


class LocalProgramError(PlanningError):
    """A tp-sharded block's forward runs another program on its local shards than globally."""


def _column_owners(block: nn.Module, spec: ModuleShardingSpec) -> list[str]:
    """The submodules whose weight is column-sharded on tp (their outputs are split by heads)."""
    params = spec.params if isinstance(spec.params, dict) else {}
    out: list[str] = []
    for rel, named in params.items():
        path, _, leaf = rel.rpartition(".")
        placement = named.get("tp")
        if leaf != "weight" or not path or not isinstance(placement, Shard):
            continue
        owner = block.get_submodule(path)
        column = placement.dim == (1 if is_conv1d(owner) else 0)
        if column and path not in out:
            out.append(path)
    return out


def _traced(spec: ModuleShardingSpec) -> bool:
    """Whether hp runs the block's own forward (no wrapper or compute stands in for it)."""
    return spec.inner_wrapper is None and spec.local_compute_fn is None


def _refuse(fqn: str, spec: ModuleShardingSpec, block: nn.Module, tp: int, why: str) -> None:
    raise propose(
        LocalProgramError(
            f"{fqn}: {type(block).__name__}'s forward computes another program on its tp={tp} "
            f"shards than on the whole model: {why}. Validate mode runs the global shapes and "
            "would match; production would train wrong, so the plan is refused before any "
            "collective. A head count the forward reads but hp does not make local is the usual "
            "cause.\nFix: view by the tensor's own size (-1) or the module's head-count "
            "attribute, list that attribute in the boundary's tp_divide_attrs, or keep the block "
            "whole on tp."
        ),
        keep_whole_proposal(fqn, spec),
    )


def _scaled(
    block: nn.Module,
    spec: ModuleShardingSpec,
    tp: int,
    owners: list[str],
    call: tuple[tuple[Any, ...], dict[str, Any]],
    global_ops: Mapping[str, list[Any]],
    trial: dict[str, tuple[int, int]],
) -> bool:
    """Whether the local program with ``trial`` local is the global program scaled."""
    try:
        ops = _run(
            _local_clone(block, spec, tp, trial),
            {p: p for p in owners},
            local_call(call, trial, tp),
        )
    except Exception:  # this set does not even run: not the one
        return False
    return all(_compare(global_ops.get(p, []), ops.get(p, []), tp) is None for p in owners)


def prove_local_programs(
    model: nn.Module,
    modules: Mapping[str, ModuleShardingSpec],
    attention: Sequence[str],
    mesh: MeshSpec,
    call: ExampleCall | None = None,
) -> None:
    """Refuse every attention boundary in ``attention`` whose local program is not the global
    one scaled by tp (see the module docstring). Blocks already proven as fused are skipped."""
    tp = mesh.size("tp")
    if tp <= 1:
        return
    todo: dict[str, tuple[ModuleShardingSpec, list[str]]] = {}
    for fqn in attention:
        spec = modules.get(fqn)
        if spec is None or spec._fused_layouts or not _traced(spec):
            continue
        owners = _column_owners(model.get_submodule(fqn), spec)
        if owners:
            todo[fqn] = (spec, owners)
    if not todo:
        return
    keys = {f: _key(model.get_submodule(f), s, tp) for f, (s, _) in todo.items()}
    reps: dict[tuple[Any, ...], str] = {}
    for fqn, key in keys.items():
        reps.setdefault(key, fqn)
    calls = _capture(model, set(reps.values()), call)
    for fqn in reps.values():
        args = calls.get(fqn)
        if args is None:
            continue  # not reached on meta: the verifier's propagation is the check
        spec, owners = todo[fqn]
        block = model.get_submodule(fqn)
        paths = {p: p for p in owners}
        try:
            global_ops = _run(_clone(block), paths, args)
        except Exception:  # user code that does not run on meta: nothing to compare
            continue
        attrs = dict(spec._tp_local_attr_plan or {})

        attempt = functools.partial(_scaled, block, spec, tp, owners, args, global_ops)
        if attempt(attrs):
            continue
        # The known names do not make the program local: find what does, and prove it.
        shown = head_search.shapes_shown(global_ops)
        width = input_width(block, spec)
        found = head_search.search_local_attrs(block, tp, shown, attrs, attempt, width=width)
        if found is not None:
            for other in (f for f, k in keys.items() if k == keys[fqn]):
                record_found(modules[other], found, attrs)
            continue
        try:
            local_ops = _run(_local_clone(block, spec, tp, attrs), paths, args)
        except Exception:  # a loud failure, not a silent one: the verifier names it at apply
            continue
        for path in owners:
            why = _compare(global_ops.get(path, []), local_ops.get(path, []), tp)
            if why is not None:
                _refuse(fqn, spec, block, tp, f"after {path}: {why}")
