"""An undo log for ``apply``: every mutation records how to reverse it.

A failed ``apply`` rolls the journal back, so the model's parameters, forwards and
attributes are exactly as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["Journal", "set_forward"]

_MISSING = object()


class Journal:
    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        #: The phase of the install under way and the module it is at, for error messages.
        self.current_phase = "install"
        self.current_module: str | None = None

    def phase(self, name: str) -> None:
        """Mark the start of an install phase (named in the error if it fails)."""
        self.current_phase, self.current_module = name, None

    def at(self, fqn: str) -> None:
        """Mark the module the current phase is working on."""
        self.current_module = fqn

    @property
    def where(self) -> str:
        if self.current_module is None:
            return self.current_phase
        return f"{self.current_phase} at {self.current_module or '<root>'}"

    def record(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def set_param(self, module: nn.Module, name: str, value: Any) -> None:
        """Replace ``module._parameters[name]`` (a Parameter, or None while detached)."""
        old = module._parameters[name]
        module._parameters[name] = value
        self.record(lambda: module._parameters.__setitem__(name, old))

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        old = obj.__dict__.get(name, _MISSING)

        def undo() -> None:
            if old is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = old

        # Straight into the instance dict: nn.Module.__setattr__ would register modules and
        # parameters, which these plain attributes (forwards, head counts, markers) are not.
        obj.__dict__[name] = value
        self.record(undo)

    def rollback(self) -> None:
        # Every undo runs even if one raises (or an interrupt arrives): a half-rolled-back
        # model is the one outcome worse than a failed apply. The first error is re-raised.
        first: BaseException | None = None
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first


def set_forward(journal: Journal, module: nn.Module, fn: Callable[..., Any]) -> None:
    """The one place that assigns ``module.forward`` (an instance attribute, undoable)."""
    journal.set_attr(module, "forward", fn)
