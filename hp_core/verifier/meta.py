"""Running a model on the meta device: a weightless copy, and answers to data-dependent questions.

Meta tensors have shapes but no values, which is all the verifier needs — except where
model code asks a question about values (``if mask.all():``, ``nonzero()``, ``.item()``).
:class:`MetaValues` answers those with the neutral case: ``all()`` is true, every other
boolean false, every number 0, and ``nonzero`` finds every element (so code that gathers
the selected tokens sees all of them). The verifier checks layouts and shapes, which do
not depend on those answers, for the common path.
"""

from __future__ import annotations

import copy
import types
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from hp_core.planner.trace import experts_need_batched

__all__ = ["MetaValues", "adapt_for_meta", "meta_clone", "to_meta"]

aten = torch.ops.aten


def _meta_local(t: Any) -> bool:
    if isinstance(t, DTensor):
        return t._local_tensor.is_meta
    return isinstance(t, torch.Tensor) and t.is_meta


class MetaValues(TorchDispatchMode):
    """Neutral answers to value queries on meta tensors (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        # id → weak reference: an id can be reused once its tensor is freed
        self._truthy: dict[int, weakref.ref[torch.Tensor]] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and _meta_local(args[0]):
            t = args[0]
            ref = self._truthy.get(id(t))
            if ref is not None and ref() is t:
                return True
            return False if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
        if func in (aten.nonzero.default, aten.argwhere.default) and _meta_local(args[0]):
            x = args[0]
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device="meta")
        if func is aten.equal.default and _meta_local(args[0]):
            return True
        out = func(*args, **kwargs)
        if (
            func in (aten.all.default, aten.all.dim, aten.all.dims)
            and isinstance(out, torch.Tensor)
            and out.is_meta
        ):
            self._truthy[id(out)] = weakref.ref(out)
        return out


def to_meta(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with ``t``'s shape, dtype and strides (a Parameter stays a Parameter)."""
    m = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    if isinstance(t, nn.Parameter):
        return nn.Parameter(m, requires_grad=t.requires_grad)
    return m


def meta_clone(model: nn.Module, shared: Mapping[str, str] | None = None) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors (tied ones stay tied).

    ``shared`` maps a submodule FQN to another one it repeats exactly (see
    ``hp_core.verifier.repeats``): the copy holds the representative's copy in both places,
    so copying a 1,000-layer model costs what its distinct layers cost.
    """
    shared = dict(shared or {})
    skip = {id(model.get_submodule(f)) for f in shared}
    memo: dict[int, Any] = {}

    def add(module: nn.Module) -> None:
        if id(module) in skip:
            return
        plain = [
            v for v in vars(module).values() if isinstance(v, torch.Tensor)
        ]  # unregistered tensors
        for t in (*module._parameters.values(), *module._buffers.values(), *plain):
            if t is not None and id(t) not in memo:
                memo[id(t)] = to_meta(t)
        for child in module._modules.values():
            if child is not None:
                add(child)

    add(model)
    # Deepest first: a representative that contains repeats of its own (experts inside a
    # layer) must find their copies in the memo when it is copied.
    for rep in sorted(dict.fromkeys(shared.values()), key=lambda f: -f.count(".")):
        original = model.get_submodule(rep)
        memo[id(original)] = copy.deepcopy(original, memo)
        for fqn, r in shared.items():
            if r == rep:
                memo[id(model.get_submodule(fqn))] = memo[id(original)]
    clone = copy.deepcopy(model, memo)
    _rebind_closures(clone, memo)
    return clone


def _rebind_closures(clone: nn.Module, memo: Mapping[int, Any]) -> None:
    """Functions a module holds that close over the model's own objects (minGPT's
    ``self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))``) call the copy's, not the original's.

    ``copy.deepcopy`` copies a function as itself, so such a lambda would keep running the
    original model's modules and parameters inside the copy.
    """
    for module in clone.modules():
        for name, value in list(vars(module).items()):
            cells = getattr(value, "__closure__", None)
            if not isinstance(value, types.FunctionType) or not cells:
                continue
            if not any(id(c.cell_contents) in memo for c in cells if _filled(c)):
                continue
            new = tuple(
                types.CellType(memo.get(id(c.cell_contents), c.cell_contents)) if _filled(c) else c
                for c in cells
            )
            module.__dict__[name] = types.FunctionType(
                value.__code__, value.__globals__, value.__name__, value.__defaults__, new
            )


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def adapt_for_meta(model: nn.Module) -> None:
    """Switch a (copied) model to kernels that have meta implementations, in training mode.

    Hugging Face MoE experts default to ``torch._grouped_mm``, whose meta kernel accepts only
    bfloat16 although the CPU kernel computes in float32; the batched implementation is the
    same math with plain matmuls. Training mode is set flag by flag, not by ``train()``: a
    Hugging Face model loaded with hub kernels re-kernelizes in ``train()``, which refuses
    the meta device. Only the verifier's copy is changed.
    """
    for module in model.modules():
        module.training = True  # dropouts active: a random op on a partial sum must be seen
        config = getattr(module, "config", None)
        if config is not None and experts_need_batched(config):
            config._experts_implementation = "batched_mm"
