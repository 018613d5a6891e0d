"""What a plan remembers of the ``plan()`` call that made it.

A refusal found after planning — by the verifier, at apply — prints only a fix hp has checked
(:mod:`hp_core.verifier.advice`), and checking one means planning the model again as the user
did, with the fix added: their overrides, their flags, their mesh. A plan keeps that call
(``ShardingPlan.planned_with``); it takes no part in the plan's equality, fingerprint or
documents.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the entries' type only; overrides.py reads plans, which hold this
    from hp_core.plans.overrides import OverrideEntry

__all__ = ["PlanningCall"]


@dataclasses.dataclass(frozen=True)
class PlanningCall:
    """The arguments of the ``plan()`` call that made a plan, less the model.

    ``flags``: ``plan()``'s keyword flags (``sequence_parallel``, ``loss_parallel``,
    ``ep_size``). ``mesh``: the mesh description it was given (None for a ``DeviceMesh``,
    which a plan does not hold). ``fingerprint``: the plan's when it was made, so a plan
    edited since is known not to be this call's any more.
    """

    overrides: tuple[OverrideEntry, ...] = ()
    flags: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    mesh: Any = None
    fingerprint: str = ""
