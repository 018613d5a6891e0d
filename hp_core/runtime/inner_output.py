"""Validate mode: the output of a child replacement checked against its declared layout."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.distributed.tensor import DTensor

from hp_core.mesh import mesh_axes
from hp_core.runtime.layouts import same_placement, to_placements
from hp_core.spec.placements import PlacementMismatchError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["InnerOutputCheck"]


class InnerOutputCheck:
    """Validate mode, dispatching region: check a child replacement's output by ``inner_out_src``.

    ``"first_input"`` means "the layout of its first tensor argument"; a mapping declares
    the layout outright. A mismatch is a ``PlacementMismatchError`` at stage ``inner_out_src``.
    """

    def __init__(
        self, name: str, fn: Callable[..., Any], inner_out_src: Any, mesh: DeviceMesh
    ) -> None:
        self.name = name
        self.fn = fn
        self.mesh = mesh
        self.declared = inner_out_src
        self.__signature__ = inspect.signature(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.fn(*args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        if self.declared == "first_input":
            src = next((a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)), None)
            expected = tuple(src.placements) if src is not None else None
        else:
            layout = next(iter(self.declared.values()))
            expected = to_placements(layout, self.mesh)
        names = list(mesh_axes(self.mesh))
        if (
            expected is None
            or not isinstance(first, DTensor)
            or not all(
                same_placement(a, e) for a, e in zip(first.placements, expected, strict=True)
            )
        ):
            actual = (
                dict(zip(names, first.placements, strict=True))
                if isinstance(first, DTensor)
                else f"a plain {type(first).__name__}"
            )
            declared = (
                dict(zip(names, expected, strict=True)) if expected is not None else self.declared
            )
            raise PlacementMismatchError(self.name, declared, actual, "inner_out_src")
        return out
