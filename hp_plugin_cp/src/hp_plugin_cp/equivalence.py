"""Hooks that run a context-parallel model through hp's one-call equivalence check.

``hp_core.testing.check_equivalence`` (and an ``EquivalenceCase``) feeds every rank the
whole batch and compares against one process. Under cp each rank must see only its part
of the sequence and ``.loss`` must be the global loss; these are the two hooks that do
what ``docs/cp.md`` does in a training loop, plus the override that turns CP attention on
for a Hugging Face model::

    check_equivalence(
        factory, batch, "cp=2",
        overrides=HF_CP_OVERRIDES,
        shard_batch=cp_shard_batch,
        after_apply=cp_global_loss,
    )

They are module-level functions so the spawned ranks can unpickle them by name.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hp_core import applied
from hp_plugin_cp.batch import shard_batch_for_cp
from hp_plugin_cp.errors import CPConfigError
from hp_plugin_cp.loss import enable_cp_loss

__all__ = ["HF_CP_OVERRIDES", "cp_global_loss", "cp_shard_batch"]

#: CP attention on every ``*.self_attn`` of a Hugging Face decoder (``docs/cp.md``): the
#: ``sdpa_hf`` wrapper replaces the attention interface the module calls.
HF_CP_OVERRIDES: list[dict[str, Any]] = [
    {
        "match": "*.self_attn",
        "when": "cp",
        "inner_target": "self",
        "inner_wrapper": "sdpa_hf",
        "region_dispatch": False,
    }
]


def cp_shard_batch(batch: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """The check's ``shard_batch`` hook: this cp rank's part of a whole batch."""
    return shard_batch_for_cp(batch, mesh["cp"])


def cp_global_loss(model: nn.Module, mode: str) -> None:
    """The check's ``after_apply`` hook: ``model(...).loss`` becomes the loss over all cp
    ranks (``enable_cp_loss`` on the mesh the model was applied on)."""
    state = applied(model)
    if state is None:
        raise CPConfigError(
            f"cp_global_loss: {type(model).__name__} has not been applied by hp "
            f"(mode {mode!r}). Fix: pass it as check_equivalence's after_apply hook, which "
            "runs after apply."
        )
    enable_cp_loss(model, state.mesh["cp"])
