"""The hp plugin object of hp-plugin-cp (entry point ``cp`` in group ``hp_core``).

Registers the four CP inner wrappers and the ``cp`` training adapter. Each wrapper is
``needs_cp=True`` (preflight refuses it on a mesh without an active cp axis) and
``region_dispatch=False`` (it communicates, so the attention region runs on local tensors
in both modes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hp_core.hookspecs import hookimpl
from hp_plugin_cp.batch import shard_batch_for_cp
from hp_plugin_cp.collectives import cp_attention_collectives
from hp_plugin_cp.loss import enable_cp_loss
from hp_plugin_cp.wrappers import flex_hf, flex_qkv, sdpa_hf, sdpa_qkv

#: The hp plugin API (hook specs + injection signatures) this plugin is built for: a
#: literal, so an hp-core speaking another version refuses it instead of misusing it.
HP_PLUGIN_API = 2

#: name → (wrapper, forward style), in registration order.
WRAPPERS = {
    "sdpa_qkv": (sdpa_qkv, "qkv"),
    "sdpa_hf": (sdpa_hf, "hf"),
    "flex_qkv": (flex_qkv, "qkv"),
    "flex_hf": (flex_hf, "hf"),
}


@hookimpl
def hp_register_inner_wrappers(register: Callable[..., None]) -> None:
    """Register ``sdpa_qkv``, ``sdpa_hf``, ``flex_qkv`` and ``flex_hf``."""
    for name, (fn, style) in WRAPPERS.items():
        register(
            name,
            fn,
            needs_cp=True,
            region_dispatch=False,
            forward_style=style,
            collectives=cp_attention_collectives,
        )


class CPTrainingAdapter:
    """The training-loop side of CP, for ``hp_core.training.TrainingAdapters`` (axis ``cp``).

    ``prepare_model``: ``enable_cp_loss`` (``.loss`` becomes the global loss);
    ``shard_batch``: ``shard_batch_for_cp`` (this rank's chunk of every sequence). No
    ``after_backward``: hp's derived reductions sum the cp-partial gradients themselves.
    """

    def __init__(self, *, load_balanced: bool = False) -> None:
        self.load_balanced = load_balanced

    def prepare_model(self, model: Any, context: Any) -> Any:
        return enable_cp_loss(model, context.cp_mesh)

    def shard_batch(self, batch: Mapping[str, Any], context: Any) -> dict[str, Any]:
        return shard_batch_for_cp(batch, context.cp_mesh, load_balanced=self.load_balanced)


@hookimpl
def hp_register_training_adapters(register: Callable[..., None]) -> None:
    """Register the ``cp`` training adapter (contiguous layout)."""
    register("cp", CPTrainingAdapter(), axis="cp")
