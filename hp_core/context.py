"""``ParallelContext``: the one description of how a job is parallel, built once.

Every layer used to work the mesh out for itself: the planner's ``when:`` axes, the
training adapters' active axes and the applier's tp/cp/ep sub-meshes were three
computations of one fact. A ``ParallelContext`` holds it once (in the spirit of
torchtitan's ``ParallelDims``): the axis names and sizes, the active axes, whether
sequence parallelism is on, and — when it is built from a real ``DeviceMesh`` — the
sub-meshes. Built from a :class:`~hp_core.MeshSpec` it has sizes only and no process
group, which is all planning needs.

Injections receive it as ``ctx`` (``factory(module, ctx, **config)``,
``wrapper(target_module, ctx, **config)``), training adapters as ``context.parallel``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from hp_core.mesh import MeshSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hp_core.plans.model import ShardingPlan

__all__ = ["GUARD_AXES", "ParallelContext"]

#: The axes an override's ``when:`` can name (``sp``: sequence parallelism is on).
GUARD_AXES = ("tp", "cp", "ep", "sp")


def _mesh_axes(mesh: object) -> tuple[str, ...]:
    return tuple(str(n) for n in (getattr(mesh, "mesh_dim_names", None) or ()))


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """Axis sizes, active axes, sequence parallelism and sub-meshes of one parallel job.

    ``sizes[i]`` is ``None`` when the size of ``axis_names[i]`` is unknown (a plan made
    for axis names only); an unknown axis counts as active. ``tp_mesh``, ``cp_mesh`` and
    ``ep_mesh`` are ``None`` where the axis is inactive or no ``DeviceMesh`` is behind
    the context. Build one with :meth:`from_mesh`, :meth:`from_spec` or :meth:`from_plan`.
    """

    axis_names: tuple[str, ...]
    sizes: tuple[int | None, ...]
    #: Experts are sharded over this many ranks (1: no expert parallelism).
    ep_size: int = 1
    #: Sequence parallelism is on: the plan asks for it and tp is active.
    sequence_parallel: bool = False
    #: The whole device mesh (None when only sizes are known).
    mesh: DeviceMesh | None = None
    tp_mesh: DeviceMesh | None = None
    cp_mesh: DeviceMesh | None = None
    #: The derived ``(edp, ep)`` expert mesh (set by ``apply`` once it has created it).
    ep_mesh: DeviceMesh | None = None

    # ------------------------------------------------------------------ building

    @classmethod
    def _build(
        cls,
        axis_names: tuple[str, ...],
        sizes: tuple[int | None, ...],
        *,
        sequence_parallel: bool,
        ep_size: int,
        mesh: DeviceMesh | None = None,
        ep_mesh: DeviceMesh | None = None,
    ) -> ParallelContext:
        known = dict(zip(axis_names, sizes, strict=True))

        def active(axis: str) -> bool:
            return axis in known and (known[axis] is None or (known[axis] or 1) > 1)

        def sub(axis: str) -> DeviceMesh | None:
            return (
                mesh[axis]
                if mesh is not None and active(axis) and axis in _mesh_axes(mesh)
                else None
            )

        return cls(
            axis_names=axis_names,
            sizes=sizes,
            ep_size=ep_size,
            sequence_parallel=bool(sequence_parallel) and active("tp"),
            mesh=mesh,
            tp_mesh=sub("tp"),
            cp_mesh=sub("cp"),
            ep_mesh=ep_mesh,
        )

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, plan: ShardingPlan | None = None) -> ParallelContext:
        """The context of a real ``DeviceMesh`` (sizes from the mesh; ep and sp from ``plan``)."""
        spec = MeshSpec.from_any(mesh)
        return cls._build(
            spec.axis_names,
            spec.sizes,
            sequence_parallel=plan.sequence_parallel if plan is not None else False,
            ep_size=plan.ep_size if plan is not None else 1,
            mesh=mesh,
        )

    @classmethod
    def from_spec(
        cls, spec: MeshSpec, *, sequence_parallel: bool = False, ep_size: int = 1
    ) -> ParallelContext:
        """Sizes only, no process group: what the planner works with."""
        return cls._build(
            spec.axis_names, spec.sizes, sequence_parallel=sequence_parallel, ep_size=ep_size
        )

    @classmethod
    def from_plan(
        cls,
        plan: ShardingPlan,
        mesh: DeviceMesh | None = None,
        *,
        ep_mesh: DeviceMesh | None = None,
    ) -> ParallelContext:
        """The context a plan was made for (its sizes; unknown sizes count as active), with the
        sub-meshes of ``mesh`` when given."""
        names = tuple(plan.mesh_axis_names)
        sizes: tuple[int | None, ...] = (
            tuple(plan.mesh_shape) if plan.mesh_shape else (None,) * len(names)
        )
        return cls._build(
            names,
            sizes,
            sequence_parallel=plan.sequence_parallel,
            ep_size=plan.ep_size,
            mesh=mesh,
            ep_mesh=ep_mesh,
        )

    def with_ep_mesh(self, ep_mesh: DeviceMesh | None) -> ParallelContext:
        """This context with the expert mesh ``apply`` created (a collective, so it comes later)."""
        return dataclasses.replace(self, ep_mesh=ep_mesh)

    # ----------------------------------------------------------------- reading

    def size(self, axis: str) -> int:
        """Size of ``axis``: 1 when the mesh lacks it (and when its size is unknown)."""
        for name, size in zip(self.axis_names, self.sizes, strict=True):
            if name == axis:
                return size or 1
        return 1

    @property
    def active_axes(self) -> tuple[str, ...]:
        """The mesh axes of size > 1 (or unknown size), in mesh order, plus ``ep`` when
        experts are sharded: the axes whose training adapters run."""
        axes = [n for n, s in zip(self.axis_names, self.sizes, strict=True) if s is None or s > 1]
        if self.ep_size > 1 and "ep" not in axes:
            axes.append("ep")
        return tuple(axes)

    @property
    def guard_axes(self) -> frozenset[str]:
        """The values of ``when:`` that hold here (``tp``, ``cp``, ``ep``; ``sp`` when sequence
        parallelism is on)."""
        active: set[str] = {a for a in ("tp", "cp") if a in self.active_axes}
        if self.ep_size > 1:
            active.add("ep")
        if self.sequence_parallel:
            active.add("sp")
        return frozenset(active)

    def __repr__(self) -> str:
        sizes = ",".join(
            f"{n}={'?' if s is None else s}"
            for n, s in zip(self.axis_names, self.sizes, strict=True)
        )
        flags = (" sp" if self.sequence_parallel else "") + (
            f" ep={self.ep_size}" if self.ep_size > 1 else ""
        )
        where = " on a DeviceMesh" if self.mesh is not None else ""
        return f"<ParallelContext {sizes or 'no axes'}{flags}{where}>"
