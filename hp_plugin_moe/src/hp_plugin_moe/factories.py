"""The EP archetype factories (``@local_compute``), registered by name from the plugin.

Each is called once at apply time with the MoE block (``module``) and the job's
``ParallelContext`` (``ctx``; its ``ep_mesh`` is the derived expert mesh, ``None``
without expert parallelism), checks the block's
interface and returns ``compute_fn(module, hidden_states)``. Every other parameter is
a config key, bound by name from YAML (``{_target_: qwen2moe, capacity_factor: 1.5}``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from hp_core.injection import local_compute
from hp_plugin_moe.compute import ExpertParallelMoE, build_compute

if TYPE_CHECKING:
    from hp_core.context import ParallelContext

__all__ = ["deepseekv3", "mixtral", "qwen2moe", "routed_only"]


@local_compute
def routed_only(
    module: nn.Module,
    ctx: ParallelContext,
    capacity_factor: float | None = None,
    router: str = "auto",
    top_k: int | None = None,
    norm_topk_prob: bool | None = None,
) -> ExpertParallelMoE:
    """Routed experts only (Qwen3-MoE, OLMoE, custom blocks with a ``gate`` and ``experts``).

    Config: ``capacity_factor`` (None: no limit), ``router`` (a router adapter name or
    ``auto``), and for computing routers (``softmax_topk``) ``top_k`` and
    ``norm_topk_prob`` (default: the block's attributes, else no renormalization).
    """
    return build_compute(
        "routed_only",
        module,
        ctx.ep_mesh,
        capacity_factor=capacity_factor,
        router=router,
        top_k=top_k,
        norm_topk_prob=norm_topk_prob,
    )


@local_compute
def mixtral(
    module: nn.Module,
    ctx: ParallelContext,
    capacity_factor: float | None = None,
    router: str = "auto",
    jitter_noise: float | None = None,
) -> ExpertParallelMoE:
    """Mixtral: top-k routed experts (weights renormalized), multiplicative router jitter.

    Config: ``capacity_factor``, ``router``, ``jitter_noise`` (in training, hidden states
    are scaled by U(1 - j, 1 + j) before routing; default: the block's ``jitter_noise``).
    """
    return build_compute(
        "mixtral",
        module,
        ctx.ep_mesh,
        capacity_factor=capacity_factor,
        router=router,
        jitter_noise=jitter_noise,
    )


@local_compute
def qwen2moe(
    module: nn.Module,
    ctx: ParallelContext,
    capacity_factor: float | None = None,
    router: str = "auto",
) -> ExpertParallelMoE:
    """Qwen2-MoE: routed experts + ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``.

    Config: ``capacity_factor`` (None: no limit), ``router`` (adapter name or ``auto``).
    """
    return build_compute(
        "qwen2moe", module, ctx.ep_mesh, capacity_factor=capacity_factor, router=router
    )


@local_compute
def deepseekv3(
    module: nn.Module,
    ctx: ParallelContext,
    capacity_factor: float | None = None,
    router: str = "auto",
) -> ExpertParallelMoE:
    """DeepSeek-V3: group-limited sigmoid router + routed experts + additive ``shared_experts``.

    Config: ``capacity_factor``, ``router`` (``auto``: the block's router module via
    ``hf_topk``; ``sigmoid_group_topk`` for a plain gate weight with
    ``e_score_correction_bias``).
    """
    return build_compute(
        "deepseekv3", module, ctx.ep_mesh, capacity_factor=capacity_factor, router=router
    )
