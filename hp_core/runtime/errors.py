"""The refusals of ``apply`` before it touches the model, and of a boundary at run time.

Kept apart from :mod:`hp_core.runtime.preflight` so that the modules preflight uses (the
expert-parallel checks) can raise them without importing preflight back.
"""

from __future__ import annotations

from hp_core.errors import HpError

__all__ = ["MeshMismatchError", "OutputNotATensorError", "PlanMismatchError", "PreflightError"]


class PreflightError(HpError, ValueError):
    """``apply`` refused before touching the model; the message says what to fix."""


class MeshMismatchError(PreflightError):
    """The mesh lacks an axis the plan needs, or its sizes differ from the plan's."""


class PlanMismatchError(PreflightError):
    """Ranks hold different plans (or one rank failed its preflight)."""


class OutputNotATensorError(HpError, TypeError):
    """A boundary's declared output that needs a layout change is not a tensor (a list, a
    dict): hp cannot apply the declared reduction to it, and passing it on would be wrong."""

    def __init__(self, fqn: str, module_type: str, name: str, value_type: str) -> None:
        self.fqn, self.module_type, self.name, self.value_type = fqn, module_type, name, value_type
        super().__init__(
            f"{fqn} ({module_type}): its output {name!r} is a {value_type}, not a tensor, but "
            "the plan declares a layout change for it (out_src -> out_dst) that only a tensor "
            "can take.\nFix: name each item the forward returns in out_names (e.g. out_names: "
            f"[{name}, attn_weights]), so the tensor among them is the one declared."
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.fqn, self.module_type, self.name, self.value_type))
