"""The hp plugin object of hp-plugin-moe (entry point ``moe`` in group ``hp_core``).

Registers the EP archetype factories with the Hugging Face architectures each is the
suggested compute for (``hp_core.plugins.suggest_compute_factory``), and the router
adapters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hp_core.hookspecs import hookimpl
from hp_plugin_moe.dispatch import moe_block_collectives
from hp_plugin_moe.factories import deepseekv3, mixtral, qwen2moe, routed_only
from hp_plugin_moe.routers import BUILTIN_ROUTERS

__all__ = [
    "FACTORIES",
    "HP_PLUGIN_API",
    "hp_register_compute_factories",
    "hp_register_router_adapters",
]

#: The hp plugin API (hook specs + injection signatures) this plugin is built for: a
#: literal, so an hp-core speaking another version refuses it instead of misusing it.
HP_PLUGIN_API = 2

#: factory name → (factory, HF architectures it is suggested for).
FACTORIES: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {
    "qwen2moe": (qwen2moe, ("Qwen2MoeForCausalLM",)),
    "mixtral": (mixtral, ("MixtralForCausalLM",)),
    "routed_only": (routed_only, ("Qwen3MoeForCausalLM", "OlmoeForCausalLM")),
    "deepseekv3": (deepseekv3, ("DeepseekV3ForCausalLM",)),
}


@hookimpl
def hp_register_compute_factories(register: Callable[..., None]) -> None:
    """Register the four EP archetype factories with their suggested architectures."""
    for name, (factory, architectures) in FACTORIES.items():
        register(name, factory, architectures=architectures, collectives=moe_block_collectives)


@hookimpl
def hp_register_router_adapters(register: Callable[..., None]) -> None:
    """Register the router adapters (``hf_topk``, ``softmax_topk``, ``sigmoid_group_topk``)."""
    for name, adapter in BUILTIN_ROUTERS.items():
        register(name, adapter)
