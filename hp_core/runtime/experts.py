"""Expert parallelism in the applier: the derived expert mesh, expert stacking and sharding.

The plan's mesh is the *dense region*. An MoE boundary with ``_ep_size = ep > 1`` keeps
its routed experts on an expert mesh ``(edp, ep)`` derived from it: the region's ranks,
in mesh order (the last axis varies fastest), are folded into rows of ``ep``
consecutive ranks. A row is an *expert group*: its ranks exchange tokens with
all-to-all and each holds ``num_experts / ep`` experts. The ranks of a column hold the
same experts (``edp`` replicas). So on ``tp=2`` with ``ep=2`` the two tp ranks form the
expert group; on ``dp=2,tp=2`` with ``ep=4`` one group spans every rank.

Which replicas hp reduces, per mesh axis, by what the MoE block's tokens are along it:

* *sharded* (the block's input is ``shard(N)`` there: tp under sequence parallelism,
  cp): ranks hold different tokens of one batch. Expert replicas that differ only on
  such axes each saw part of the tokens; hp sums their gradients, once per step.
* *data* (``dp*`` axes, and axes the plan places nothing on): ranks hold different
  batches; reducing over them is data parallelism's job (FSDP/DDP), not hp's.
* *replicated* (the plan uses the axis but the block's input is whole there, e.g. tp
  without sequence parallelism): ranks hold the same tokens. An expert group must not
  span such an axis (every token would reach its experts twice); preflight says how
  to shard the tokens instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor

from hp_core.mesh import MeshSpec, is_data_axis
from hp_core.plans.model import ShardingPlan
from hp_core.plans.overrides import compile_glob
from hp_core.runtime.errors import PreflightError
from hp_core.runtime.grads import GradReduction
from hp_core.runtime.journal import Journal
from hp_core.runtime.param_layout import ParamLayout, layout_of
from hp_core.runtime.partial import data_axes, is_expert_param
from hp_core.spec.module_spec import ModuleShardingSpec, layout_map

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "EXPERT_MESH_AXES",
    "ExpertGroups",
    "ExpertLayout",
    "ExpertParallelError",
    "ShardedExperts",
    "StackedExperts",
    "build_expert_groups",
    "check_expert_boundary",
    "every_layer",
    "expert_grad_reductions",
    "expert_layout",
    "expert_matches",
    "expert_placements",
    "override_entries",
    "shard_expert_parameters",
]

#: Names of the derived expert mesh's dimensions.
EXPERT_MESH_AXES: tuple[str, str] = ("edp", "ep")


class ExpertParallelError(PreflightError):
    """An expert-parallel boundary that cannot be laid out on this mesh or model."""


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How one ep size folds the dense region (pure data, identical on every rank).

    ``groups`` are the expert groups (rows of ``(edp, ep)``); ``replica_groups`` the
    sets of expert replicas whose gradients hp sums (singletons when there is nothing
    to sum); ``spanned`` the mesh axes an expert group spans.
    """

    ep: int
    ranks: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    replica_groups: tuple[tuple[int, ...], ...]
    spanned: tuple[str, ...]

    @property
    def edp(self) -> int:
        return len(self.ranks) // self.ep

    @property
    def sums_replicas(self) -> bool:
        return any(len(g) > 1 for g in self.replica_groups)


@dataclasses.dataclass
class ExpertGroups:
    """The process groups of one ep size: the ``(edp, ep)`` mesh and the replica group."""

    layout: ExpertLayout
    mesh: DeviceMesh  # dims EXPERT_MESH_AXES
    replica_group: ProcessGroup | None  # this rank's replicas


class StackedExperts(nn.Module):
    """Replaces a per-expert ``ModuleList``: one ``[E, ...]`` parameter per projection.

    Children mirror the stacked names, so ``experts.w1.weight`` of the plan is a real
    parameter path. ``num_experts`` is the global count; the parameters hold this rank's
    ``num_experts / ep`` experts.
    """

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}"


# ------------------------------------------------------------------ pure layout


def every_layer(fqn: str) -> str:
    """A glob for the same block in every layer: ``model.layers.0.mlp`` → ``model.layers.*.mlp``."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", fqn)


def expert_matches(plan: ShardingPlan, fqn: str) -> list[str]:
    """Override keys that hit exactly the plan's expert-parallel blocks, for pasteable fixes.

    One glob (``model.layers.*.mlp``) when it matches no other boundary; otherwise (dense
    MLPs between MoE layers, as in DeepSeek-V3) the blocks' FQNs one by one.
    """
    blocks = [f for f, s in plan.items() if s.is_boundary and s._ep_size > 1]
    glob = every_layer(fqn)
    pattern = compile_glob(glob)
    return [glob] if [f for f in plan if pattern.fullmatch(f)] == blocks else blocks


def override_entries(matches: list[str], body: str) -> str:
    """YAML override entries, one per match, each followed by the indented ``body`` lines."""
    return "".join(f"  - match: {m!r}\n{body}" for m in matches)


def expert_placements(named: Mapping[str, Placement]) -> tuple[Placement, Placement]:
    """The ``(edp, ep)`` placements of an expert parameter declared as ``{ep: ...}``."""
    return (Replicate(), named.get("ep", Replicate()))


def _plan_axes(plan: ShardingPlan) -> set[str]:
    """Axes the plan places something non-replicated on (anything but ``ep``)."""
    used: set[str] = set()
    for spec in plan.modules.values():
        for field in ("params", "in_src", "in_dst", "out_src", "out_dst"):
            value = getattr(spec, field)
            if isinstance(value, dict):
                for named in value.values():
                    used.update(
                        a for a, p in named.items() if a != "ep" and not isinstance(p, Replicate)
                    )
    return used


def _spanned_axes(fqn: str, ep: int, mesh: MeshSpec) -> tuple[str, ...]:
    """The innermost axes one expert group covers; raises when ep cuts across the mesh."""
    spanned: list[str] = []
    covered = 1
    for name, size in zip(reversed(mesh.axis_names), reversed(mesh.sizes), strict=True):
        if covered == ep:
            break
        need = ep // covered
        if ep % covered or (need >= size and need % size) or (need < size and size % need):
            break
        covered *= min(need, size)
        if size > 1:
            spanned.append(name)
    if covered != ep:
        inner = [math.prod(mesh.sizes[i:]) for i in range(len(mesh.sizes))]
        raise ExpertParallelError(
            f"{fqn}: ep_size={ep} does not fit the mesh {mesh}: an expert group is ep consecutive "
            "ranks in mesh order, so it must cover whole inner axes plus a divisor of the next one "
            f"(sizes that fit here divide one of {sorted(set(inner))}). Plan with such an ep_size."
        )
    return tuple(spanned)


def expert_layout(
    fqn: str, spec: ModuleShardingSpec, plan: ShardingPlan, mesh: MeshSpec, ranks: tuple[int, ...]
) -> ExpertLayout:
    """Fold the dense region for ``spec._ep_size``; raise what cannot work (no process group)."""
    ep = spec._ep_size
    world = len(ranks)
    if world % ep:
        divisors = [d for d in range(2, world + 1) if world % d == 0]
        raise ExpertParallelError(
            f"{fqn}: ep_size={ep} does not divide the dense region's {world} ranks (mesh {mesh}); "
            "the expert mesh (edp, ep) folds those ranks into groups of ep. Plan with ep_size in "
            f"{divisors}."
        )
    spanned = _spanned_axes(fqn, ep, mesh)
    sharded = data_axes(spec)  # the block's tokens
    used = _plan_axes(plan)

    def kind(axis: str) -> str:
        if axis in sharded:
            return "sharded"
        if is_data_axis(axis) or axis not in used:
            return "data"
        return "replicated"

    dup = [a for a in spanned if kind(a) == "replicated"]
    if dup:
        axis = dup[0]
        name = next(iter(layout_map(spec.in_dst) or ["hidden_states"]))
        raise ExpertParallelError(
            f"{fqn}: the expert group of ep={ep} spans the {axis!r} axis, along which this block's "
            f"tokens are replicated (its input {name!r} is whole on {axis}), so every token would "
            f"reach its experts {mesh.size(axis)} times. Plan with sequence_parallel=True, or "
            "shard the block's tokens with an override:\n"
            + override_entries(
                expert_matches(plan, fqn),
                f"    when: ep\n    in_dst: {{{name}: {{{axis}: shard(1)}}}}\n    out_src: "
                f"{{output: {{{axis}: shard(1)}}}}\n",
            ).rstrip("\n")
        )
    names, sizes = mesh.axis_names, mesh.sizes

    def coords(i: int) -> tuple[int, ...]:
        out = []
        for size in reversed(sizes):
            out.append(i % size)
            i //= size
        return tuple(reversed(out))

    keep = [k for k, a in enumerate(names) if kind(a) != "sharded"]
    buckets: dict[tuple[Any, ...], list[int]] = {}
    for i in range(world):
        c = coords(i)
        buckets.setdefault((i % ep, *(c[k] for k in keep)), []).append(ranks[i])
    replica_groups = tuple(sorted(tuple(g) for g in buckets.values()))
    groups = tuple(tuple(ranks[r * ep : (r + 1) * ep]) for r in range(world // ep))
    return ExpertLayout(
        ep=ep, ranks=ranks, groups=groups, replica_groups=replica_groups, spanned=spanned
    )


def _param(module: nn.Module, rel: str) -> nn.Parameter | None:
    path, _, name = rel.rpartition(".")
    return (module.get_submodule(path) if path else module)._parameters.get(name)


def _container(source: str, stacked: str) -> tuple[str, str]:
    """``("experts", "w1.weight")`` for ``experts.3.w1.weight`` stacked as ``experts.w1.weight``."""
    s, t = source.split("."), stacked.split(".")
    for k in range(len(t)):
        if s[:k] == t[:k] and s[k].isdigit() and s[k + 1 :] == t[k:]:
            return ".".join(s[:k]), ".".join(t[k:])
    raise ExpertParallelError(
        f"_ep_stack: {source!r} is not a per-expert path of {stacked!r} (expected the stacked path "
        "with one expert index inserted, e.g. experts.3.w1.weight for experts.w1.weight)."
    )


def _stacks_by_container(spec: ModuleShardingSpec) -> dict[str, dict[str, list[str]]]:
    out: dict[str, dict[str, list[str]]] = {}
    for stacked, sources in spec._ep_stack.items():
        container, _tail = _container(sources[0], stacked)
        out.setdefault(container, {})[stacked] = list(sources)
    return out


def check_expert_boundary(fqn: str, spec: ModuleShardingSpec, module: nn.Module) -> None:
    """The compute runs on local tensors, expert parameters sit on ``ep`` only, and per-expert
    modules can be stacked whole."""
    if spec.region_dispatch is not False:
        raise ExpertParallelError(
            f"{fqn}: an expert-parallel compute communicates (all-to-all over the expert group), "
            "so it runs on local tensors: declare region_dispatch: false."
        )
    for rel, named in layout_map(spec.params).items():
        if "ep" in named:
            extra = {a: p for a, p in named.items() if a != "ep" and not isinstance(p, Replicate)}
            if extra:
                raise ExpertParallelError(
                    f"{fqn}.params.{rel}: an expert parameter lives on the expert mesh (edp, ep) "
                    f"and can only be placed on ep; it also has {extra}. Declare it as {{ep: "
                    "shard(0)}."
                )
    for container, stacks in _stacks_by_container(spec).items():
        try:
            holder = module.get_submodule(container)
        except AttributeError:
            raise ExpertParallelError(
                f"{fqn}: _ep_stack names {container!r}, which {type(module).__name__} does not "
                "have."
            ) from None
        listed = {src for sources in stacks.values() for src in sources}
        own = {f"{container}.{n}" for n, _ in holder.named_parameters()}
        missing = sorted(listed - own)
        if missing:
            raise ExpertParallelError(
                f"{fqn}: per-expert parameter(s) {missing[:4]} of _ep_stack do not exist in the "
                "model."
            )
        rest = sorted(own - listed)
        buffers = [f"{container}.{n}" for n, _ in holder.named_buffers()]
        if rest or buffers:
            raise ExpertParallelError(
                f"{fqn}: the per-expert modules under {container!r} hold {rest + buffers} besides "
                "the stacked projections; stacking would drop them. Declare them in _ep_stack, or "
                "keep the experts replicated (ep_size=1)."
            )
        for stacked, sources in stacks.items():
            shapes = {tuple(p.shape) for src in sources if (p := _param(module, src)) is not None}
            if len(shapes) != 1:
                raise ExpertParallelError(
                    f"{fqn}: the experts' {stacked} have different shapes {sorted(shapes)}; they "
                    "cannot be stacked."
                )


# ------------------------------------------------------------------ process groups


@functools.cache
def _cached_groups(device_type: str, layout: ExpertLayout, world_key: int) -> ExpertGroups:
    ranks = torch.tensor(layout.ranks, dtype=torch.int).reshape(layout.edp, layout.ep)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=EXPERT_MESH_AXES)
    mine = None
    if layout.sums_replicas:
        me = dist.get_rank()
        for group in layout.replica_groups:  # every rank creates every group, in the same order
            pg = dist.new_group(ranks=list(group))
            if me in group:
                mine = pg
    return ExpertGroups(layout=layout, mesh=mesh, replica_group=mine)


def build_expert_groups(
    mesh: DeviceMesh, layouts: Mapping[int, ExpertLayout]
) -> dict[int, ExpertGroups]:
    """The expert mesh and replica group of each ep size (collective; cached per process)."""
    world_key = id(dist.distributed_c10d._get_default_group())
    return {ep: _cached_groups(mesh.device_type, layouts[ep], world_key) for ep in sorted(layouts)}


# ------------------------------------------------------------------ parameters


def _distribute(
    t: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    mode: str,
    requires_grad: bool,
    layouts: dict[int, ParamLayout],
) -> nn.Parameter:
    # A copy first: replicating broadcasts into the source's storage, which is the caller's
    # parameter until the install commits (a rollback must find this rank's own values).
    data = t if t.is_meta else t.detach().clone()
    dt = distribute_tensor(data, mesh, placements, src_data_rank=None if t.is_meta else 0)
    if mode == "validate":
        return nn.Parameter(dt, requires_grad=requires_grad)
    new = nn.Parameter(dt.to_local(), requires_grad=requires_grad)
    layout = layout_of(dt)
    if layout is not None:  # the expert-mesh layout its state-dict view carries
        layouts[id(new)] = layout
    return new


def _expert_boundaries(
    model: nn.Module, plan: ShardingPlan
) -> Iterator[tuple[str, ModuleShardingSpec, nn.Module]]:
    for fqn, spec in plan.items():
        if spec._ep_size > 1:
            yield fqn, spec, (model.get_submodule(fqn) if fqn else model)


@dataclasses.dataclass
class ShardedExperts:
    """The expert parameters' new copies (made collectively), not yet installed."""

    #: ``(owner module, attribute, old, new)`` of expert parameters sharded where they are.
    params: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]]
    #: ``(MoE block, its spec, stacked name → new parameter)``: containers to swap.
    stacks: list[tuple[nn.Module, ModuleShardingSpec, dict[str, nn.Parameter]]]
    #: ``id(new) -> layout`` on the expert mesh of each production expert parameter.
    layouts: dict[int, ParamLayout] = dataclasses.field(default_factory=dict)

    def install(self, journal: Journal) -> dict[int, nn.Parameter]:
        """Swap the copies in (local, journaled); returns ``id(old) → new``."""
        done: dict[int, nn.Parameter] = {}
        for owner, name, old, new in self.params:
            done[id(old)] = new
            journal.set_param(owner, name, new)
        for module, spec, stacked in self.stacks:
            _install_stacked(module, spec, stacked, journal)
        return done


def shard_expert_parameters(
    model: nn.Module, plan: ShardingPlan, mode: str, experts: Mapping[int, ExpertGroups]
) -> ShardedExperts:
    """Stack per-expert parameters, then keep this rank's experts (collective; model untouched).

    production: local ``[E / ep, ...]`` shards as plain parameters; validate: DTensors on
    the expert mesh, ``(Replicate(), Shard(0))`` on ``(edp, ep)``.
    """
    out = ShardedExperts([], [])
    for _fqn, spec, module in _expert_boundaries(model, plan):
        emesh = experts[spec._ep_size].mesh
        stacked: dict[str, nn.Parameter] = {}
        for rel, named in layout_map(spec.params).items():
            if not is_expert_param(spec, named):
                continue
            sources = spec._ep_stack.get(rel)
            if sources:
                olds = [p for p in (_param(module, s) for s in sources) if p is not None]
                full = torch.stack([p.detach() for p in olds])
                stacked[rel] = _distribute(
                    full, emesh, expert_placements(named), mode, olds[0].requires_grad, out.layouts
                )
                continue
            path, _, name = rel.rpartition(".")
            owner = module.get_submodule(path) if path else module
            old = owner._parameters[name]
            if old is None or isinstance(old, DTensor):
                continue
            new = _distribute(
                old, emesh, expert_placements(named), mode, old.requires_grad, out.layouts
            )
            out.params.append((owner, name, old, new))
        if stacked:
            out.stacks.append((module, spec, stacked))
    return out


def _install_stacked(
    module: nn.Module, spec: ModuleShardingSpec, stacked: dict[str, nn.Parameter], journal: Journal
) -> None:
    """Swap each per-expert container for a ``StackedExperts`` holding the stacked parameters."""
    for container, stacks in _stacks_by_container(spec).items():
        new = StackedExperts(num_experts=len(next(iter(stacks.values()))))
        for rel in stacks:
            _c, tail = _container(spec._ep_stack[rel][0], rel)
            *path, pname = tail.split(".")
            holder: nn.Module = new
            for part in path:
                if part not in holder._modules:
                    holder.add_module(part, nn.Module())
                holder = holder._modules[part]  # type: ignore[assignment]
            holder.register_parameter(pname, stacked[rel])
        parent_path, _, attr = container.rpartition(".")
        parent = module.get_submodule(parent_path) if parent_path else module
        old = parent._modules[attr]
        parent._modules[attr] = new
        journal.record(functools.partial(parent._modules.__setitem__, attr, old))


def expert_grad_reductions(
    plan: ShardingPlan, experts: Mapping[int, ExpertGroups] | None
) -> list[GradReduction]:
    """The sum of expert gradients over each replica group (none where the groups are singletons).

    Derived from the expert layout: replicas that differ only on axes along which the
    block's tokens are sharded each saw part of the tokens (see the module docstring).
    """
    out: list[GradReduction] = []
    for fqn, spec in plan.items():
        if spec._ep_size <= 1 or not experts or experts[spec._ep_size].replica_group is None:
            continue
        group = experts[spec._ep_size].replica_group
        for rel, named in layout_map(spec.params).items():
            if is_expert_param(spec, named):
                name = f"{fqn}.{rel}" if fqn else rel
                out.append(GradReduction(name, (f"experts(ep={spec._ep_size})",), "experts", group))
    return out
