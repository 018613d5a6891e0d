"""The applier and the pieces it installs on a model (SPEC §5).

``apply`` (``hp_core.runtime.applier``) checks everything first — preflight and the
verifier, on every rank, before any mutation or collective — then installs the plan
(``hp_core.runtime.install``): parameters, boundaries, inner wraps, attributes, the
derived gradient reductions and the loss, every mutation journaled so that a failure
leaves the model as it was.
"""

from __future__ import annotations

from hp_core.runtime.applier import apply, finalize_grads
from hp_core.runtime.install import AppliedModel
from hp_core.runtime.preflight import (
    MeshMismatchError,
    PlanMismatchError,
    PreflightError,
)
from hp_core.runtime.verdict import ApplyFailedError, RankTimeoutError

__all__ = [
    "AppliedModel",
    "ApplyFailedError",
    "MeshMismatchError",
    "PlanMismatchError",
    "PreflightError",
    "RankTimeoutError",
    "apply",
    "finalize_grads",
]
