"""Router adapters: how a block's router turns hidden states into top-k (weights, experts).

An adapter is ``adapter(module, hidden, options) -> (weights [T, K], experts [T, K])``
where ``module`` is the MoE block, ``hidden`` its tokens ``[T, H]`` and ``options`` a
:class:`RouterOptions`. Adapters are a registry (``hp_register_router_adapters``); a
factory's ``router`` config key names one, ``"auto"`` picks by the router's type.
Adapters call the router *module* (``module.gate(...)``) where they can, so its
forward hooks (e.g. transformers' router-logit recording) still fire.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hp_core.plugins import ROUTER_ADAPTER_REGISTRY, lookup
from hp_plugin_moe.errors import MoEConfigError
from hp_plugin_moe.interface import find_router, interface_error

__all__ = [
    "BUILTIN_ROUTERS",
    "RouterAdapter",
    "RouterOptions",
    "auto_router",
    "hf_topk",
    "resolve_router",
    "sigmoid_group_topk",
    "softmax_topk",
]

RouterAdapter = Callable[
    [nn.Module, torch.Tensor, "RouterOptions"], tuple[torch.Tensor, torch.Tensor]
]


@dataclasses.dataclass(frozen=True)
class RouterOptions:
    """What a computing adapter needs beyond the module (resolved when the factory is bound).

    ``top_k``: experts per token; ``normalize``: renormalize the chosen weights to sum 1.
    Adapters that call a self-contained router module (``hf_topk``) take neither.
    """

    top_k: int | None = None
    normalize: bool = False


def _attr(module: nn.Module, router: nn.Module, *names: str) -> Any:
    for owner in (router, module):
        for name in names:
            value = getattr(owner, name, None)
            if value is not None and not isinstance(value, nn.Module):
                return value
    return None


def hf_topk(
    module: nn.Module, hidden: torch.Tensor, options: RouterOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """A router module returning ``(logits, weights, experts)`` (transformers 5.x MoE routers)."""
    _name, router = find_router("hf_topk", module)
    out = router(hidden)
    if not (isinstance(out, tuple) and len(out) == 3):
        raise interface_error(
            "router adapter hf_topk",
            module,
            f"its router {type(router).__name__} returned {type(out).__name__}, not "
            "(logits, weights, experts).",
            "use router: softmax_topk (a router that returns logits) or another router adapter.",
        )
    return out[1], out[2]


def softmax_topk(
    module: nn.Module, hidden: torch.Tensor, options: RouterOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """A router that returns logits (e.g. an ``nn.Linear`` gate): softmax, top-k, optional
    renorm."""
    _name, router = find_router("softmax_topk", module)
    logits = router(hidden)
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    weights, experts = torch.topk(probs, int(options.top_k or 0), dim=-1)
    if options.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(hidden.dtype), experts


def sigmoid_group_topk(
    module: nn.Module, hidden: torch.Tensor, options: RouterOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing from a gate weight: sigmoid scores, group-limited top-k.

    Reads ``weight`` and ``e_score_correction_bias`` from the router (or the block) and
    ``num_group`` (or ``n_group``), ``topk_group``, ``routed_scaling_factor``,
    ``norm_topk_prob`` and ``top_k`` from the router or the block.
    """
    _name, router = find_router("sigmoid_group_topk", module)
    weight = getattr(router, "weight", None)
    bias = _attr(module, router, "e_score_correction_bias")
    groups, topk_group = (
        _attr(module, router, "num_group", "n_group"),
        _attr(module, router, "topk_group"),
    )
    if not isinstance(weight, torch.Tensor) or bias is None or groups is None or topk_group is None:
        raise interface_error(
            "router adapter sigmoid_group_topk",
            module,
            "it lacks a router weight, e_score_correction_bias, num_group (n_group) or topk_group.",
            "use the router adapter that matches this router (hf_topk for transformers' "
            "DeepSeek-V3 router).",
        )
    scaling = _attr(module, router, "routed_scaling_factor") or 1.0
    logits = F.linear(hidden.float(), weight.float())
    scores = logits.sigmoid()
    choice = scores + bias
    n_experts = choice.shape[-1]
    group_scores = choice.view(-1, groups, n_experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1).expand(-1, groups, n_experts // groups).reshape(-1, n_experts)
    )
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    experts = torch.topk(choice, k=int(options.top_k or 0), dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if options.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, experts


#: The adapters this plugin registers, by name.
BUILTIN_ROUTERS: dict[str, RouterAdapter] = {
    "hf_topk": hf_topk,
    "softmax_topk": softmax_topk,
    "sigmoid_group_topk": sigmoid_group_topk,
}
#: Adapters that compute the routing themselves and therefore need ``top_k``.
COMPUTING = frozenset({"softmax_topk", "sigmoid_group_topk"})


def auto_router(module: nn.Module, factory: str) -> str:
    """``hf_topk`` for a router module; for a plain ``nn.Linear`` gate, ``sigmoid_group_topk``
    when an ``e_score_correction_bias`` is present, else ``softmax_topk``."""
    _name, router = find_router(factory, module)
    if not isinstance(router, nn.Linear):
        return "hf_topk"
    has_bias = _attr(module, router, "e_score_correction_bias") is not None
    return "sigmoid_group_topk" if has_bias else "softmax_topk"


def resolve_router(name: str, module: nn.Module, factory: str) -> tuple[str, RouterAdapter]:
    """The adapter for ``name`` (``"auto"``, a registry name, or a built-in name)."""
    if not isinstance(name, str):
        raise MoEConfigError(
            f"{factory}: router is {name!r}.\n"
            "router must be a router adapter name.\n"
            "Fix: set router: auto, or a registered adapter name such as softmax_topk."
        )
    if name == "auto":
        name = auto_router(module, factory)
    if name not in ROUTER_ADAPTER_REGISTRY and name in BUILTIN_ROUTERS:
        return name, BUILTIN_ROUTERS[
            name
        ]  # the plugin's own adapters work even when it is not loaded
    # Unknown names raise UnknownRegistryItemError listing the known ones and the closest match.
    return name, lookup("router_adapter", name).value


def router_options(
    factory: str,
    module: nn.Module,
    router_name: str,
    *,
    top_k: int | None,
    normalize: bool | None,
    default_normalize: bool,
) -> RouterOptions:
    """Resolve ``top_k`` / ``normalize`` for a computing adapter (config, then module
    attributes)."""
    if router_name not in COMPUTING:
        given = [k for k, v in (("top_k", top_k), ("norm_topk_prob", normalize)) if v is not None]
        if given:
            raise MoEConfigError(
                f"{factory}: config key(s) {given} do nothing with router {router_name!r}.\n"
                f"With {router_name!r} the router module chooses the experts itself.\n"
                "Fix: remove them, or pick a computing router (softmax_topk)."
            )
        return RouterOptions()
    _name, router = find_router(factory, module)
    k = top_k if top_k is not None else _attr(module, router, "top_k", "num_experts_per_tok")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise MoEConfigError(
            f"{factory}: {type(module).__name__} has no integer top_k attribute (got {k!r}).\n"
            f"Router {router_name!r} needs the number of experts per token.\n"
            "Fix: set the config key top_k: N."
        )
    norm = normalize if normalize is not None else _attr(module, router, "norm_topk_prob")
    return RouterOptions(top_k=k, normalize=default_normalize if norm is None else bool(norm))
