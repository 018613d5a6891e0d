"""Training adapters: the per-axis steps a training loop needs, from the plugins that know them.

A plan says how modules are sharded; some axes also need the *loop* to change (context
parallelism cuts every batch along the sequence and sums the gradients over cp). Plugins
register that knowledge with ``hp_register_training_adapters``; :class:`TrainingAdapters`
selects the adapters of the plan's active axes and calls them, so a generic loop needs no
plugin imports::

    adapters = TrainingAdapters.for_plan(plan, mesh, model=model)
    model = adapters.prepare_model(model)
    loss = model(**adapters.shard_batch(batch)).loss
    loss.backward()
    adapters.after_backward(model)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hp_core.context import ParallelContext
from hp_core.plans.model import ShardingPlan
from hp_core.plugins import TRAINING_ADAPTER_REGISTRY

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TrainingAdapters", "TrainingContext"]


@dataclasses.dataclass(frozen=True)
class TrainingContext:
    """What an adapter method receives: the job's :class:`~hp_core.ParallelContext` and the plan.

    ``mesh``, ``tp_mesh``, ``cp_mesh`` and ``ep_mesh`` read the parallel context's (None
    where the axis is inactive).
    """

    parallel: ParallelContext
    plan: ShardingPlan

    @property
    def mesh(self) -> DeviceMesh | None:
        return self.parallel.mesh

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.parallel.tp_mesh

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        return self.parallel.cp_mesh

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        return self.parallel.ep_mesh


class TrainingAdapters:
    """The training adapters selected for one plan, bound to their :class:`TrainingContext`."""

    def __init__(self, adapters: Mapping[str, Any], context: TrainingContext) -> None:
        self.adapters = dict(adapters)
        self.context = context

    @classmethod
    def for_plan(
        cls,
        plan: ShardingPlan,
        mesh: DeviceMesh | None,
        *,
        model: Any = None,
        registry: Mapping[str, Any] | None = None,
    ) -> TrainingAdapters:
        """Select the registered adapters whose axis is active in ``plan`` (registry order).

        ``model``: the applied model, whose expert mesh becomes ``context.ep_mesh``.
        ``registry``: name → ``RegisteredItem`` (default: ``TRAINING_ADAPTER_REGISTRY``).
        """
        if registry is None:
            registry = TRAINING_ADAPTER_REGISTRY
        applied = getattr(model, "_hp_applied", None)
        ep_mesh = (
            getattr(applied, "expert_meshes", {}).get(plan.ep_size) if applied is not None else None
        )
        parallel = ParallelContext.from_plan(plan, mesh, ep_mesh=ep_mesh)
        active = set(parallel.active_axes)
        chosen = {
            name: item.value for name, item in registry.items() if item.meta["axis"] in active
        }
        return cls(chosen, TrainingContext(parallel=parallel, plan=plan))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.adapters)

    def _each(self, method: str) -> list[Any]:
        return [fn for a in self.adapters.values() if (fn := getattr(a, method, None)) is not None]

    def prepare_model(self, model: Any) -> Any:
        """Call every ``prepare_model``; an adapter may return a replacement model."""
        for fn in self._each("prepare_model"):
            result = fn(model, self.context)
            if result is not None:
                model = result
        return model

    def shard_batch(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """Pass the whole batch through every ``shard_batch`` in turn; returns this rank's batch."""
        out = dict(batch)
        for fn in self._each("shard_batch"):
            out = dict(fn(out, self.context))
        return out

    def after_backward(self, model: Any) -> None:
        """Call every ``after_backward`` (e.g. gradient reductions), before the optimizer step."""
        for fn in self._each("after_backward"):
            fn(model, self.context)

    def __repr__(self) -> str:
        return f"<TrainingAdapters {', '.join(self.names) or 'none'}>"
