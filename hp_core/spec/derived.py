"""``Derived``: what templates and the planner derive for one spec, in one record.

A user writes the contract fields of a ``ModuleShardingSpec``; the planner adds facts it
derived from the model (the tp-local attribute plan, the deferred biases, whether the
module is the terminal head, needs context-parallel attention, stacks expert
parameters). They live here rather than as loose private attributes, and are written
through one door: ``spec.with_derived(...)``. The spec's ``_tp_local_attr_plan``,
``_deferred_bias_params``, ... attributes read (and, for compatibility, replace) the
record's values. The field order is the key order under a plan document's ``_internal:``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Derived"]


@dataclasses.dataclass(frozen=True)
class Derived:
    """The planner-derived facts of one spec (see the module docstring)."""

    #: ``attribute -> (global, local)`` values of head counts divided by tp.
    tp_local_attr_plan: dict[str, tuple[int, int]] | None = None
    #: Biases added after the reduction of a partial output (once, not per rank).
    deferred_bias_params: tuple[str, ...] = ()
    #: The module is the model's output head (loss parallel applies here).
    is_terminal: bool = False
    #: The module's attention must run context-parallel.
    needs_cp_attn: bool = False
    #: ``stacked parameter path -> [source expert parameter paths]``.
    ep_stack: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    #: Expert-parallel degree the stack was made for (0: none).
    ep_size: int = 0
    #: ``param path -> fused layout`` (``hp_core.planner.fused_layout.FusedLayout`` as data)
    #: of the fused projections tp re-arranges so each rank holds whole heads of every part.
    fused_layouts: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def replace(self, **facts: Any) -> Derived:
        """This record with ``facts`` replaced (what ``dataclasses.replace`` does, without its
        per-call field walk: specs get their derived facts on the planner's hot path)."""
        unknown = set(facts) - _NAMES
        if unknown:
            raise TypeError(
                f"Derived has no field {sorted(unknown)[0]!r}; its fields are "
                f"{', '.join(sorted(_NAMES))}."
            )
        new = object.__new__(Derived)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(facts)
        return new

    def copy(self) -> Derived:
        """A record whose containers are independent of this one's."""
        plan = self.tp_local_attr_plan
        return Derived(
            tp_local_attr_plan=dict(plan) if plan is not None else None,
            deferred_bias_params=tuple(self.deferred_bias_params),
            is_terminal=self.is_terminal,
            needs_cp_attn=self.needs_cp_attn,
            ep_stack={k: list(v) for k, v in self.ep_stack.items()},
            ep_size=self.ep_size,
            fused_layouts={k: dict(v) for k, v in self.fused_layouts.items()},
        )


_NAMES = frozenset(f.name for f in dataclasses.fields(Derived))
