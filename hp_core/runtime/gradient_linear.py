"""Backward kernels that are linear in the incoming gradient keep it a partial sum.

A parameter kept whole in a region whose data is sequence-sharded gets a *partial* gradient
(each rank's share of the sum over tokens). When the parameter went through a pointwise
function (Ergo's residual gate: ``sigmoid(w)``, ``softplus(w)``), autograd runs that function's
backward kernel on the partial gradient. Those kernels multiply the incoming gradient by a
function of the saved value (``softplus_backward(g, x) = g * sigmoid(beta x)``, or ``g``
above the threshold; ``sigmoid_backward(g, y) = g * y (1 - y)``; ``tanh_backward(g, y) =
g (1 - y^2)``), so ``P(g), R(x) -> P`` is exact. torch 2.13's DTensor does not list them
as linear: it all-reduces the gradient first, which inside a strict validate region is an
undeclared redistribution, and the token-wise fix is refused although production, which sums
once at the end, computes the same.

:func:`register_partial_gradient_rules` adds that rule (and the same for ``Partial("avg")``)
to torch's own pointwise strategy of each kernel, through the registration torch uses for its
linear ops; every other placement is decided as before. It is called wherever validate mode
installs a model. A torch without that registration keeps its own strategy: such fixes are
then refused, never wrong.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

try:  # the registration torch 2.13 gives its own linear pointwise ops
    from torch.distributed.tensor._ops._pointwise_ops import (
        _register_single_dim_pointwise as _register,
    )
except ImportError:  # pragma: no cover - a torch that moved it: keep torch's strategies
    _register = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from torch._ops import OpOverload

__all__ = ["GRADIENT_LINEAR_OPS", "register_partial_gradient_rules"]

_aten = torch.ops.aten
#: Backward kernels ``k(grad, saved, ...)`` linear in ``grad`` for a fixed ``saved``.
GRADIENT_LINEAR_OPS: tuple[OpOverload, ...] = (
    _aten.softplus_backward.default,
    _aten.sigmoid_backward.default,
    _aten.tanh_backward.default,
)

_done: set[OpOverload] = set()


def register_partial_gradient_rules() -> tuple[OpOverload, ...]:
    """Let a partial gradient pass through :data:`GRADIENT_LINEAR_OPS` (the saved value
    replicated). Idempotent; returns the ops registered by this call."""
    register: Any = _register
    if register is None:  # pragma: no cover - see the import
        return ()
    rules = [[Partial(r), Partial(r), Replicate()] for r in ("sum", "avg")]
    new = [op for op in GRADIENT_LINEAR_OPS if op not in _done]
    for op in new:
        register(op, rules)
        _done.add(op)
    if new:  # decisions cached before the rule existed would all-reduce again
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    return tuple(new)
