"""Inference whose sequence sequence parallelism cannot split runs without sequence parallelism.

``generate()`` decodes one token per step; sequence parallelism shards the sequence over
tp and cannot split one position. Under ``torch.no_grad`` hp then runs that forward with
the plan's whole-sequence variant: every activation layout ``shard(1)`` on tp becomes
``replicate`` (exactly what the planner derives with ``sequence_parallel=False``; the
parameters keep their layouts, so nothing is re-sharded). Each boundary holds both
wirings and the input guard, which sees the sequence length first, picks one per forward.

The variant is verified once, the first time it is needed, on a weightless copy of the
model kept from ``apply`` (no collective; every rank reaches the same verdict).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from torch.distributed.tensor import Placement, Replicate, Shard

from hp_core.plans.model import ShardingPlan
from hp_core.spec.module_spec import copy_spec

__all__ = ["SequenceFallback", "SequenceSwitch", "whole_sequence_plan"]

_ACTIVATIONS = ("in_src", "in_dst", "out_src", "out_dst")


def _whole(
    layouts: Mapping[str, Mapping[str, Placement]] | None,
) -> dict[str, dict[str, Placement]] | None:
    if layouts is None:
        return None
    return {
        name: {
            a: (Replicate() if a == "tp" and isinstance(p, Shard) and p.dim == 1 else p)
            for a, p in named.items()
        }
        for name, named in layouts.items()
    }


def whole_sequence_plan(plan: ShardingPlan) -> ShardingPlan:
    """``plan`` with sequence parallelism off: tp ``shard(1)`` activations become ``replicate``."""
    modules = {}
    for fqn, spec in plan.items():
        new = copy_spec(spec)
        for field in _ACTIVATIONS:
            setattr(new, field, _whole(getattr(spec, field)))
        modules[fqn] = new
    return ShardingPlan(
        modules=modules,
        mesh_axis_names=plan.mesh_axis_names,
        mesh_shape=plan.mesh_shape,
        sequence_parallel=False,
        loss_parallel=plan.loss_parallel,
        ep_size=plan.ep_size,
    )


class SequenceFallback:
    """Whether this forward runs the whole-sequence variant, and its one-time verification."""

    def __init__(self, plan: ShardingPlan, verify: Callable[[ShardingPlan], Any]) -> None:
        self.variant = whole_sequence_plan(plan)
        self._verify = verify
        self.verified = False
        self.active = False
        self.uses = 0

    def engage(self) -> None:
        """This (gradient-free) forward cannot split its sequence: run it whole."""
        if not self.verified:
            self._verify(self.variant)  # raises the verifier's refusal on every rank alike
            self.verified = True
        self.active = True
        self.uses += 1


class SequenceSwitch:
    """A boundary's forward with both wirings: sequence-parallel, and whole-sequence."""

    def __init__(
        self, split: Callable[..., Any], whole: Callable[..., Any], fallback: SequenceFallback
    ) -> None:
        self.split = split
        self.whole = whole
        self.fallback = fallback
        self.__signature__ = inspect.signature(split)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self.whole if self.fallback.active else self.split)(*args, **kwargs)
