"""The names a parallelized model's state-dict entries had before ``apply``.

``apply`` keeps every parameter's name except where expert parallelism stacks a
per-expert ``ModuleList`` (``experts.3.w1.weight``, one per expert) into one
``StackedExperts`` parameter (``experts.w1.weight`` of shape ``[E, ...]``); the plan's
``_ep_stack`` records which per-expert names each stacked one holds, in expert order.
``original_names`` reads that record, so exporting (``hp_core.checkpoint.export``) and
loading pretrained weights agree on one mapping.
"""

from __future__ import annotations

from torch import nn

from hp_core.runtime.applied import applied, applied_module
from hp_core.runtime.experts import StackedExperts

__all__ = ["original_names", "stacked_names"]


def stacked_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """``stacked name → per-expert names`` for every stack ``apply`` installed on ``model``."""
    state = applied(model)
    if state is None:
        return {}
    module = applied_module(model)
    out: dict[str, tuple[str, ...]] = {}
    for fqn, spec in state.plan.items():
        if spec._ep_size <= 1:
            continue
        prefix = f"{fqn}." if fqn else ""
        for rel, sources in spec._ep_stack.items():
            if _inside_stack(module, prefix + rel):
                out[prefix + rel] = tuple(prefix + s for s in sources)
    return out


def _inside_stack(module: nn.Module, name: str) -> bool:
    """Whether ``name`` is a parameter under a ``StackedExperts`` (ep=1 stacks nothing)."""
    parts = name.split(".")[:-1]
    return any(
        isinstance(module.get_submodule(".".join(parts[:k])), StackedExperts)
        for k in range(1, len(parts) + 1)
    )


def original_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """``current state-dict key → the key(s) it had before apply``, for every key of the
    state dict of the module ``apply`` was given (through DDP / ``torch.compile``).

    A stacked expert parameter maps to its per-expert keys, one per expert in expert order
    (its row ``i`` is the ``i``-th key); every other key maps to itself. A model hp did not
    apply maps each key to itself.
    """
    module = applied_module(model)
    stacked = stacked_names(module)
    return {key: stacked.get(key, (key,)) for key in module.state_dict()}
