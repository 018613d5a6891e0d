"""Validate mode: a ``region_dispatch: true`` inner wrapper's forward, failures named.

With ``region_dispatch: true`` validate mode dispatches DTensors through the wrapper's
replacement forward (production passes local tensors). A wrapper written for plain
tensors then fails deep inside torch (``aten.add.Tensor: got mixed torch.Tensor and
DTensor``) with nothing pointing at the module or the flag; this call site turns such a
failure into :class:`~hp_core.injection.InjectionCallError` naming both.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch.distributed.tensor import DTensor

from hp_core.errors import HpError
from hp_core.injection import InjectionCallError

__all__ = ["RegionWrapperCall"]


def _dtensor_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    values = [*(f"argument {i}" for i in range(len(args))), *kwargs]
    return [
        f"{where} ({list(v.placements)})"
        for where, v in zip(values, (*args, *kwargs.values()), strict=True)
        if isinstance(v, DTensor)
    ]


class RegionWrapperCall:
    """Calls ``fn``, the replacement forward that inner wrapper ``name`` (of ``plan[fqn]``)
    installed on module ``target``; an exception other than hp's own becomes
    :class:`InjectionCallError` (chained)."""

    def __init__(
        self, fqn: str, target: str, name: str, provider: str, fn: Callable[..., Any]
    ) -> None:
        self.fqn = fqn
        self.target = target
        self.name = name
        self.provider = provider
        self.fn = fn
        self.__signature__ = inspect.signature(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.fn(*args, **kwargs)
        except HpError:
            raise
        except Exception as e:
            raise self._error(e, _dtensor_inputs(args, kwargs)) from e

    def _error(self, e: Exception, dtensors: list[str]) -> InjectionCallError:
        received = (
            f"It has region_dispatch: true, so in validate mode it receives DTensors (here: "
            f"{', '.join(dtensors)}), and local tensors in production."
            if dtensors
            else "It has region_dispatch: true (in validate mode it receives DTensors, in "
            "production local tensors)."
        )
        return InjectionCallError(
            f"plan[{self.fqn!r}].inner_wrapper: the forward of inner wrapper {self.name!r} (from "
            f"{self.provider}) failed for module {self.target!r} in validate mode: "
            f"{type(e).__name__}: {e}\n{received}\n"
            "Fix: make the wrapper DTensor-aware (only ops DTensor has sharding rules for, or "
            "to_local() / DTensor.from_local around the rest), or set region_dispatch: false in "
            "the override for "
            f"{self.fqn!r} so it runs on local tensors in both modes. The original exception is "
            "chained below.",
            name=self.name,
            provider=self.provider,
            fqn=self.target,
            kind="inner_wrapper",
        )
