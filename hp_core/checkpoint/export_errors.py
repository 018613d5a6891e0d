"""What the checkpoint calls refuse: a model hp did not apply, an argument out of range."""

from __future__ import annotations

from hp_core.errors import HpError

__all__ = ["ExportArgumentError", "ExportNotAppliedError"]


class ExportNotAppliedError(HpError, TypeError):
    """``hp_core.full_state_dict`` got a model that ``hp_core.apply`` did not parallelize."""


class ExportArgumentError(HpError, ValueError):
    """An argument of ``hp_core.full_state_dict`` that is not what it takes."""
