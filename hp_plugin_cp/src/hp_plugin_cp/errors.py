"""The errors hp-plugin-cp raises. Each message names the module or batch key and the fix."""

from __future__ import annotations

from hp_core import HpError

__all__ = [
    "CPBatchError",
    "CPConfigError",
    "CPError",
    "CPMaskError",
    "CPMisfireError",
    "CPUnsupportedError",
]


class CPError(HpError):
    """Base class of every hp-plugin-cp error."""


class CPConfigError(CPError, ValueError):
    """A CP wrapper is bound to something it cannot serve (no cp axis, a bad target, ...)."""


class CPBatchError(CPError, ValueError):
    """A batch cannot be sharded for CP, or a sharded batch does not fit the attention."""


class CPMaskError(CPError, ValueError):
    """An attention mask a CP wrapper cannot honour (e.g. one built from the local chunk only)."""


class CPMisfireError(CPError, RuntimeError):
    """An ``*_hf`` wrapper saw no SDPA / flex-attention call during its module's forward."""


class CPUnsupportedError(CPError, NotImplementedError):
    """A feature the CP wrappers (or torch, on this device) do not support."""
