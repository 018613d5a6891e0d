"""The errors of plans, plan documents and overrides (one base: :class:`PlanError`)."""

from __future__ import annotations

from hp_core.bounded import InputLimitError
from hp_core.errors import HpError
from hp_core.spec.merge import IncompleteContractError

__all__ = [
    "ArgumentTypeError",
    "DuplicateOverrideError",
    "IncompleteOverrideError",
    "OverrideError",
    "OverrideMatchWarning",
    "OverridesTypeError",
    "PlanError",
    "PlanTypeError",
    "PlanYAMLError",
    "PlanYAMLInputLimitError",
]


class PlanError(HpError, ValueError):
    """A malformed plan, plan document or override (base class)."""


class PlanYAMLError(PlanError):
    """A plan document (YAML text, file or dict) that cannot be read or written."""


class PlanYAMLInputLimitError(PlanYAMLError, InputLimitError):
    """A plan or overrides document over hp's input limits (size, nesting depth, YAML alias
    expansion; see :mod:`hp_core.bounded`): both a :class:`PlanYAMLError` and an
    :class:`~hp_core.bounded.InputLimitError`."""


class OverrideError(PlanError):
    """An override entry that is malformed or does not fit the model and mesh."""


class IncompleteOverrideError(OverrideError, IncompleteContractError):
    """An override that inserts a new boundary without declaring its full contract."""


class DuplicateOverrideError(OverrideError):
    """Two exact override entries for the same module (and the same ``when``)."""


class ArgumentTypeError(HpError, TypeError):
    """A public function got an argument of the wrong type (``plan(None, ...)``)."""


class PlanTypeError(ArgumentTypeError, PlanYAMLError):
    """``load_plan`` / ``dump_plan`` got something that is not a plan source / a ShardingPlan."""


class OverridesTypeError(ArgumentTypeError, OverrideError):
    """``overrides`` of a type that holds no overrides (neither YAML, a path, a dict nor a list)."""


class OverrideMatchWarning(UserWarning):
    """A glob override matched no derived boundary (it has no effect)."""
