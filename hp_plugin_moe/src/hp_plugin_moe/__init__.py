"""hp-plugin-moe: expert parallelism (EP) for hp.

Ships the EP archetype factories (``qwen2moe``, ``mixtral``, ``routed_only``,
``deepseekv3``), router adapters, all-to-all dispatch/combine and the module-interface
checks. The plugin is discovered by hp through the ``moe`` entry point in the
``hp_core`` group (see :mod:`hp_plugin_moe.plugin`); hp's applier derives the expert
mesh and stacks per-expert weights. See ``docs/ep.md``.
"""

from __future__ import annotations

from hp_plugin_moe.compute import ARCHETYPES, Archetype, ExpertParallelMoE, build_compute
from hp_plugin_moe.dispatch import TokenDispatcher, moe_block_collectives
from hp_plugin_moe.errors import MoEConfigError, MoEInterfaceError, MoERuntimeError
from hp_plugin_moe.factories import deepseekv3, mixtral, qwen2moe, routed_only
from hp_plugin_moe.interface import ExpertWeights, describe_module, find_experts, find_router
from hp_plugin_moe.routers import RouterOptions, hf_topk, sigmoid_group_topk, softmax_topk

__version__ = "0.1.0"

__all__ = [
    "ARCHETYPES",
    "Archetype",
    "ExpertParallelMoE",
    "ExpertWeights",
    "MoEConfigError",
    "MoEInterfaceError",
    "MoERuntimeError",
    "RouterOptions",
    "TokenDispatcher",
    "__version__",
    "build_compute",
    "deepseekv3",
    "describe_module",
    "find_experts",
    "find_router",
    "hf_topk",
    "mixtral",
    "moe_block_collectives",
    "qwen2moe",
    "routed_only",
    "sigmoid_group_topk",
    "softmax_topk",
]
