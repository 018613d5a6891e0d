"""The refusals of ``apply`` before it touches the model.

Kept apart from :mod:`hp_core.runtime.preflight` so that the modules preflight uses (the
expert-parallel checks) can raise them without importing preflight back.
"""

from __future__ import annotations

from hp_core.errors import HpError

__all__ = ["MeshMismatchError", "PlanMismatchError", "PreflightError"]


class PreflightError(HpError, ValueError):
    """``apply`` refused before touching the model; the message says what to fix."""


class MeshMismatchError(PreflightError):
    """The mesh lacks an axis the plan needs, or its sizes differ from the plan's."""


class PlanMismatchError(PreflightError):
    """Ranks hold different plans (or one rank failed its preflight)."""
