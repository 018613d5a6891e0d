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
        while self._undo:
            self._undo.pop()()


def set_forward(journal: Journal, module: nn.Module, fn: Callable[..., Any]) -> None:
    """The one place that assigns ``module.forward`` (an instance attribute, undoable)."""
    journal.set_attr(module, "forward", fn)
