"""Parameter sharding: ``distribute_tensor`` every declared parameter once.

Validate keeps the DTensor parameters; production keeps only the local shard, as a
plain ``nn.Parameter``, for good. The copies are made first and swapped in afterwards, so
the caller's parameters (objects and values) survive until the install commits. Tied
parameters (one Parameter reachable under two names) are sharded once and stay tied. Meta
tensors stay meta. Expert parameters of an expert-parallel boundary go to the derived
expert mesh instead (``hp_core.runtime.experts``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from hp_core.errors import HpError
from hp_core.plans.model import ShardingPlan
from hp_core.runtime.experts import ExpertGroups, ShardedExperts, shard_expert_parameters
from hp_core.runtime.fused import FusedShards, fused_shards
from hp_core.runtime.journal import Journal
from hp_core.runtime.layouts import dense_mesh, to_placements
from hp_core.runtime.param_layout import ParamLayout, layout_of
from hp_core.runtime.partial import is_expert_param
from hp_core.spec.module_spec import layout_map

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "ParameterPlacementError",
    "ShardedParameters",
    "declared_params",
    "outside_boundaries",
    "shard_parameters",
]


def _owner(module: nn.Module, rel: str) -> tuple[nn.Module, str]:
    path, _, name = rel.rpartition(".")
    return (module.get_submodule(path) if path else module), name


def declared_params(
    model: nn.Module, plan: ShardingPlan
) -> Iterator[tuple[str, str, nn.Module, str, dict]]:
    """``(boundary fqn, relative name, owning module, attribute, named placement)`` in plan order.

    Stacked expert parameters (``_ep_stack``) are left out: they have no owner until
    ``shard_expert_parameters`` creates it.
    """
    for fqn, spec in plan.items():
        module = model.get_submodule(fqn) if fqn else model
        for rel, named in layout_map(spec.params).items():
            if rel in spec._ep_stack:
                continue
            owner, name = _owner(module, rel)
            yield fqn, rel, owner, name, named


class ParameterPlacementError(HpError, ValueError):
    """A parameter placement that cannot be carried out where the parameter is used."""


def outside_boundaries(plan: ShardingPlan) -> set[str]:
    """FQNs of non-boundary specs that no boundary encloses (their module runs in model code)."""
    bounds = [f for f, s in plan.items() if s.is_boundary]
    return {
        f
        for f, s in plan.items()
        if not s.is_boundary and not any(b == "" or f.startswith(b + ".") for b in bounds)
    }


def _distribute(
    t: torch.Tensor, mesh: DeviceMesh, named: dict, mode: str, fused: FusedShards | None = None
) -> tuple[torch.Tensor, ParamLayout | None]:
    # A copy first: replicating broadcasts into the source's storage, and the source is the
    # caller's parameter until the install commits (a rollback must find this rank's values).
    data = t.detach() if t.is_meta else t.detach().clone()
    if fused is not None:  # contiguous shards of the re-arranged tensor: whole heads per part
        data = fused.rearrange(data)
    # Rank 0's values are the truth, as in DTensor: every rank (dp replicas too) ends up
    # with the same model. Meta tensors carry no values, so they are only chunked.
    dt = distribute_tensor(
        data, mesh, to_placements(named, mesh), src_data_rank=None if data.is_meta else 0
    )
    if mode != "validate":
        layout = layout_of(dt)
        if layout is not None and fused is not None and fused.moves:
            layout = dataclasses.replace(layout, fused=fused)
        return dt.to_local(), layout
    dense = dense_mesh(mesh)
    if dense is mesh:
        return dt, None
    local = DTensor.from_local(dt.to_local(), dense, to_placements(named, dense), run_check=False)
    return local, None


@dataclasses.dataclass
class ShardedParameters:
    """Sharded copies of every declared parameter, made before the model is touched.

    Making them is collective (rank 0's values are broadcast or scattered); installing them
    is local and journaled, so a failure on any rank after the copies exist costs no
    collective to undo.
    """

    #: ``(owner module, attribute, old, new)`` in plan order.
    params: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]]
    experts: ShardedExperts | None
    #: ``id(new) -> layout`` of every sharded production parameter (experts' included).
    layouts: dict[int, ParamLayout] = dataclasses.field(default_factory=dict)
    #: ``id(new) -> FusedShards`` of every re-arranged validate parameter (production's are in
    #: its layout).
    fused: dict[int, FusedShards] = dataclasses.field(default_factory=dict)

    def install(self, model: nn.Module, journal: Journal) -> dict[int, nn.Parameter]:
        """Swap the copies in; returns ``id(old) → new``."""
        done = self.experts.install(journal) if self.experts is not None else {}
        for owner, name, old, new in self.params:
            done[id(old)] = new
            journal.set_param(owner, name, new)
        # Tied aliases that no boundary names (e.g. lm_head.weight declared only once) follow.
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) in done and module._parameters[name] is not done[id(p)]:
                    journal.set_param(module, name, done[id(p)])
        return done


def shard_parameters(
    model: nn.Module,
    plan: ShardingPlan,
    mesh: DeviceMesh,
    mode: str,
    experts: Mapping[int, ExpertGroups] | None = None,
) -> ShardedParameters:
    """The sharded copy of every declared parameter (collective; the model is untouched).

    ``experts`` (ep size → expert mesh, from preflight) is needed when the plan has
    expert-parallel boundaries. Every check runs before the first collective.
    """
    outside = outside_boundaries(plan)
    work: list[tuple[nn.Module, str, nn.Parameter, dict, str, FusedShards | None]] = []
    dims = tuple(mesh.mesh_dim_names or ())
    tp = mesh.size(dims.index("tp")) if "tp" in dims else 1
    for fqn, rel, owner, name, named in declared_params(model, plan):
        if is_expert_param(plan[fqn], named):
            continue  # on the expert mesh, below
        old = owner._parameters[name]
        if old is None or isinstance(old, DTensor):
            continue
        if fqn in outside and any(not isinstance(p, Replicate) for p in named.values()):
            # Used by the model's own code between boundaries, where only local tensors flow.
            raise ParameterPlacementError(
                f"{fqn}.{rel}: its module is not inside any boundary, so it runs on local tensors "
                f"in the model's own code and cannot be sharded ({named}). Make {fqn!r} a boundary "
                "(is_boundary: true, with in/out layouts), or keep the parameter replicated."
            )
        fused = fused_shards(fqn, plan[fqn]._fused_layouts, rel, tuple(old.shape), tp)
        # Outside any boundary it stays a plain (replicated) tensor in both modes.
        work.append((owner, name, old, named, "production" if fqn in outside else mode, fused))
    sharded_experts = shard_expert_parameters(model, plan, mode, experts) if experts else None
    made: dict[int, nn.Parameter] = {}
    layouts: dict[int, ParamLayout] = {}
    fused_by_id: dict[int, FusedShards] = {}
    out: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
    for owner, name, old, named, how, fused in work:
        new = made.get(id(old))  # a tied parameter is sharded once and stays tied
        if new is None:
            value, layout = _distribute(old, mesh, named, how, fused)
            new = made[id(old)] = nn.Parameter(value, requires_grad=old.requires_grad)
            if layout is not None:
                layouts[id(new)] = layout
            if how == "validate" and fused is not None and fused.moves:
                fused_by_id[id(new)] = fused
        out.append((owner, name, old, new))
    if sharded_experts is not None:
        layouts.update(sharded_experts.layouts)
    return ShardedParameters(out, sharded_experts, layouts, fused_by_id)
