"""The region input's hidden width, read as local by a forward that derives sizes from it.

nanoGPT-style attention reads its widths off its input: ``B, T, C = x.size()``, then
``view(B, T, n_head, C // n_head)`` and ``view(B, T, C)``. In production the input of a
tp-sharded attention region is whole (its hidden dim is never split), so ``C`` is the
global width while the projections' outputs are ``1/tp`` of it: no attribute fixes that.
For a boundary whose proof needed it (``hp_core.planner.head_search`` offers the
candidate), the region's hidden-width inputs are handed to the forward as
:class:`LocalWidth`: a view of the same tensor (same storage, same autograd graph) whose
``size()`` and ``shape`` answer the last dim divided by tp, and which every other op sees
as the plain tensor it is (its outputs are plain tensors). So only the shape reads differ,
and only the first op on the input pays the Python dispatch. The local-program gate runs
the same wrapping on the meta device, so the proof checks exactly what production runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["INPUT_WIDTH", "LocalWidth", "present_local"]

#: The entry of a tp-local attribute plan (and ``tp_divide_attrs``) that marks the
#: region's input width as read local: ``(global width, local width)``; no attribute.
INPUT_WIDTH = "<input width>"

_SHAPE = torch.Tensor.shape.__get__  # type: ignore[attr-defined]


class LocalWidth(torch.Tensor):
    """A tensor whose size reads give its last dim divided by ``_hp_tp`` (see the module)."""

    _hp_tp: int

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)  # on the tensor itself: outputs come out plain
        if func is torch.Tensor.size or func == _SHAPE:  # a fresh method-wrapper each time
            me = args[0]
            last = me.dim() - 1
            if isinstance(out, torch.Size):
                return torch.Size([*out[:-1], out[-1] // me._hp_tp]) if last >= 0 else out
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(dim, int) and dim % max(me.dim(), 1) == last:
                return out // me._hp_tp
        return out


def present_local(
    args: tuple[Any, ...], kwargs: dict[str, Any], width: int, tp: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` with each tensor of hidden width ``width`` (its last dim) shown to
    the forward as :class:`LocalWidth`; everything else as it is."""

    def wrap(x: Any) -> Any:
        # A plain tensor only: a region on DTensors reads the global widths, rightly.
        if type(x) is torch.Tensor and x.dim() >= 2 and x.shape[-1] == width:
            out = x.as_subclass(LocalWidth)
            out._hp_tp = tp
            return out
        return x

    return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}
