"""What ``apply`` leaves on a model, and how to find it: ``applied(model)``.

``apply`` records its state on the module it parallelized (``model._hp_applied``): the
plan, the mesh and parallel context, each boundary's forward, the derived gradient
reductions, and which inner wrapper it installed where. This introspection lives on the
applied model, never in the plan, so a plan stays the same data however often it is
applied. Gradient clipping, ``finalize_grads`` and the testing helpers read it here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from torch import nn
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torch.distributed.device_mesh import DeviceMesh

    from hp_core.context import ParallelContext
    from hp_core.plans.model import ShardingPlan
    from hp_core.runtime.boundary import BoundaryForward
    from hp_core.runtime.fused import FusedShards
    from hp_core.runtime.grads import GradReducer
    from hp_core.runtime.guard import InputGuard
    from hp_core.runtime.param_layout import ParamLayout
    from hp_core.runtime.rng import RngStreams
    from hp_core.runtime.sequence import SequenceFallback
    from hp_core.verifier.report import VerifyReport

__all__ = ["AppliedModel", "InnerWrap", "applied", "applied_module", "finalize_grads"]


@dataclasses.dataclass(frozen=True)
class InnerWrap:
    """An inner wrapper ``apply`` installed: its name and the FQN of the module it wraps."""

    wrapper: str
    target: str


@dataclasses.dataclass
class AppliedModel:
    """What ``apply`` left on the model (``model._hp_applied``), for introspection."""

    plan: ShardingPlan
    mode: str
    mesh: DeviceMesh
    forwards: dict[str, BoundaryForward]
    #: The derived gradient reductions (None when no gradient is partial anywhere).
    grad_reducer: GradReducer | None
    #: ep size → the derived ``(edp, ep)`` expert mesh its experts live on.
    expert_meshes: dict[int, DeviceMesh] = dataclasses.field(default_factory=dict)
    #: What the verifier proved, or None if skipped.
    report: VerifyReport | None = None
    #: The input guard (None when apply(check_inputs=False)).
    guard: InputGuard | None = None
    #: The tp-shared / tp-local random streams (``hp_core.runtime.rng``).
    rng: RngStreams | None = None
    #: The whole-sequence variant for inference that cannot split its sequence.
    fallback: SequenceFallback | None = None
    #: Boundary FQN → the inner wrapper installed there (boundaries without one are absent).
    inner_wraps: dict[str, InnerWrap] = dataclasses.field(default_factory=dict)
    #: The parallel context the injections received.
    context: ParallelContext | None = None
    #: Production: each sharded parameter's layout by name (the state-dict and optimizer
    #: views read it); empty in validate mode, where the parameters are DTensors.
    layouts: Mapping[str, ParamLayout] = dataclasses.field(default_factory=dict)
    #: Validate: ``parameter name -> FusedShards`` of re-arranged fused DTensor parameters.
    fused: Mapping[str, FusedShards] = dataclasses.field(default_factory=dict)


def applied_module(model: nn.Module) -> nn.Module:
    """The module ``apply`` was called on, through DDP and ``torch.compile`` wrappers
    (``model`` itself when none of them holds an applied module)."""
    seen = model
    while "_hp_applied" not in seen.__dict__:
        if isinstance(seen, DistributedDataParallel):
            seen = seen.module
        elif isinstance(orig := getattr(seen, "_orig_mod", None), nn.Module):  # torch.compile
            seen = orig
        else:
            break
    return seen


def applied(model: nn.Module) -> AppliedModel | None:
    """What ``apply`` recorded on ``model`` (through DDP / ``torch.compile`` wrappers), or
    None for a model hp did not parallelize."""
    state = applied_module(model).__dict__.get("_hp_applied")
    return state if isinstance(state, AppliedModel) else None


def finalize_grads(model: nn.Module) -> None:
    """Run the pending gradient reductions now.

    hp runs them automatically at the end of every backward; calling this afterwards
    changes nothing. It is there for code that reads gradients before backward returns.
    """
    state = getattr(model, "_hp_applied", None)
    if state is not None and state.grad_reducer is not None:
        state.grad_reducer.flush()
