"""``ExpertParallelMoE``: the ``compute_fn(module, hidden_states)`` every EP factory returns.

router (an adapter) → dispatch over the expert group → local SwiGLU experts → combine →
weighted scatter back to the tokens → plus the shared experts of the archetype.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from hp_plugin_moe.dispatch import TokenDispatcher
from hp_plugin_moe.errors import MoEConfigError, MoERuntimeError
from hp_plugin_moe.interface import (
    ExpertWeights,
    find_experts,
    find_router,
    forward_signature,
    has_any,
    interface_error,
)
from hp_plugin_moe.routers import RouterAdapter, RouterOptions, resolve_router, router_options

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ARCHETYPES", "Archetype", "ExpertParallelMoE", "build_compute"]

SharedKind = Literal["none", "gated", "additive"]


@dataclasses.dataclass(frozen=True)
class Archetype:
    """What a factory asserts about a block: its shared experts and its routing defaults."""

    name: str
    shared: SharedKind
    summary: str
    default_normalize: bool = False


#: The four archetypes (factory name → what it expects).
ARCHETYPES: dict[str, Archetype] = {
    "routed_only": Archetype("routed_only", "none", "routed experts only"),
    "mixtral": Archetype(
        "mixtral", "none", "top-k routed experts, optional router jitter", default_normalize=True
    ),
    "qwen2moe": Archetype("qwen2moe", "gated", "routed experts + a sigmoid-gated shared expert"),
    "deepseekv3": Archetype(
        "deepseekv3", "additive", "group-limited sigmoid router + additive shared experts"
    ),
}
_SHARED_CHILDREN = {
    "gated": ("shared_expert", "shared_expert_gate"),
    "additive": ("shared_experts",),
}
_FACTORY_FOR_SHARED = {"gated": "qwen2moe", "additive": "deepseekv3", "none": "routed_only"}


def _check_shared(arch: Archetype, module: nn.Module) -> None:
    if arch.shared != "none":
        need = _SHARED_CHILDREN[arch.shared]
        missing = [n for n in need if not isinstance(getattr(module, n, None), nn.Module)]
        if missing:
            present = (
                "gated"
                if has_any(module, _SHARED_CHILDREN["gated"])
                else "additive"
                if has_any(module, _SHARED_CHILDREN["additive"])
                else "none"
            )
            raise interface_error(
                arch.name,
                module,
                f"it lacks {', '.join(repr(m) for m in missing)}, which the {arch.name} "
                f"archetype ({arch.summary}) needs.",
                "use the factory for this block's layout "
                f"({_FACTORY_FOR_SHARED[present]!r}), e.g. local_compute_fn: "
                f"{_FACTORY_FOR_SHARED[present]}.",
            )
        return
    found = has_any(module, _SHARED_CHILDREN["gated"] + _SHARED_CHILDREN["additive"])
    if found:
        kind = "gated" if found[0] in _SHARED_CHILDREN["gated"] else "additive"
        raise interface_error(
            arch.name,
            module,
            f"it has shared experts ({', '.join(found)}), which {arch.name} ({arch.summary}) "
            "would silently drop.",
            f"use local_compute_fn: {_FACTORY_FOR_SHARED[kind]}.",
        )


def _ep_group(arch: str, ep_mesh: DeviceMesh | None, num_experts: int) -> ProcessGroup | None:
    if ep_mesh is None:
        return None
    names = tuple(getattr(ep_mesh, "mesh_dim_names", None) or ())
    sub = ep_mesh["ep"] if "ep" in names and len(names) > 1 else ep_mesh
    ep = sub.size()
    if num_experts % ep:
        raise MoEConfigError(
            f"{arch}: {num_experts} experts cannot be split over ep={ep} ranks.\n"
            "Each ep rank holds the same number of whole experts.\n"
            f"Fix: plan with an ep_size that divides {num_experts}."
        )
    return sub.get_group() if ep > 1 else None


class ExpertParallelMoE:
    """The compute of one MoE block: ``compute(module, hidden_states)``.

    Its signature mirrors the block's forward (behind the leading ``module``), as hp's
    preflight requires. ``dispatcher`` exposes the latest call's statistics.
    """

    def __init__(
        self,
        arch: Archetype,
        module: nn.Module,
        *,
        experts: ExpertWeights,
        router: tuple[str, RouterAdapter],
        options: RouterOptions,
        dispatcher: TokenDispatcher,
        jitter_noise: float = 0.0,
    ) -> None:
        self.arch = arch
        self.experts = experts
        self.router_name, self.router = router
        self.options = options
        self.dispatcher = dispatcher
        self.jitter_noise = jitter_noise
        forward = forward_signature(module)
        self.input_name = next(iter(forward.parameters))
        self.__signature__ = forward.replace(
            parameters=[
                inspect.Parameter("module", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                *forward.parameters.values(),
            ]
        )

    def __repr__(self) -> str:
        return (
            f"ExpertParallelMoE({self.arch.name}, "
            f"experts={self.experts.num_experts} {self.experts.kind}, "
            f"ep={self.dispatcher.ep}, router={self.router_name})"
        )

    def _hidden(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> torch.Tensor:
        bound = self.__signature__.bind(module, *args, **kwargs)
        for name, value in bound.arguments.items():
            if (
                name not in ("module", self.input_name)
                and value is not self.__signature__.parameters[name].default
            ):
                raise MoERuntimeError(
                    f"{self.arch.name}: {type(module).__name__} was called with {name}={value!r}; "
                    f"the MoE compute routes {self.input_name!r} only.\n"
                    "An input the compute does not route would be silently ignored.\n"
                    f"Fix: call it without {name!r}, or write a factory that uses it."
                )
        return bound.arguments[self.input_name]

    def _run_experts(
        self, module: nn.Module, rows: torch.Tensor, counts: list[int]
    ) -> torch.Tensor:
        w = self.experts.local(module)
        if w.num_local != len(counts):
            raise MoERuntimeError(
                f"{self.arch.name}: {type(module).__name__} holds {w.num_local} experts on this "
                f"rank, but the compute was bound for {len(counts)} (= "
                f"{self.experts.num_experts} experts / ep={self.dispatcher.ep}).\n"
                "The experts must stay sharded as the factory was bound.\n"
                "Fix: apply the plan the factory was bound with; do not reshard the experts "
                "afterwards."
            )
        # Every local expert runs, even on zero rows, so every expert weight gets a gradient.
        return torch.cat([w.apply(j, part) for j, part in enumerate(rows.split(counts))])

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden = self._hidden(module, args, kwargs)
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        if self.jitter_noise > 0 and module.training:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        weights, chosen = self.router(module, x, self.options)
        out = self.dispatcher(
            x, weights, chosen, lambda rows, counts: self._run_experts(module, rows, counts)
        )
        if self.arch.shared == "gated":
            # nn.Module.__getattr__ is typed Tensor | Module, so child modules read as uncallable.
            gate = F.sigmoid(module.shared_expert_gate(x))  # type: ignore[operator]
            out = out + gate * module.shared_expert(x)  # type: ignore[operator]
        elif self.arch.shared == "additive":
            out = out + module.shared_experts(x)  # type: ignore[operator]
        return out.reshape(shape)


def _check_capacity(arch: str, capacity_factor: Any) -> float | None:
    if capacity_factor is None:
        return None
    if (
        isinstance(capacity_factor, bool)
        or not isinstance(capacity_factor, int | float)
        or capacity_factor <= 0
    ):
        raise MoEConfigError(
            f"{arch}: capacity_factor is {capacity_factor!r}.\n"
            "capacity_factor must be a positive number (or null for no capacity limit).\n"
            "Fix: set capacity_factor: 1.25 (say), or capacity_factor: null."
        )
    return float(capacity_factor)


def build_compute(
    arch_name: str,
    module: nn.Module | None,
    ep_mesh: DeviceMesh | None,
    *,
    capacity_factor: float | None = None,
    router: str = "auto",
    top_k: int | None = None,
    norm_topk_prob: bool | None = None,
    jitter_noise: float | None = None,
) -> ExpertParallelMoE:
    """Check ``module`` against the archetype and build its compute (the body of every factory)."""
    arch = ARCHETYPES[arch_name]
    if not isinstance(module, nn.Module):
        raise MoEConfigError(
            f"{arch_name}: module is {module!r}.\n"
            f"{arch_name} needs the MoE block as 'module'.\n"
            f"Fix: name {arch_name} as the MoE block's local_compute_fn in the plan (hp passes the "
            "block), or call it with module=<the MoE block>."
        )
    find_router(arch_name, module)
    experts = find_experts(arch_name, module)
    _check_shared(arch, module)
    forward_signature(module)
    capacity = _check_capacity(arch_name, capacity_factor)
    name, adapter = resolve_router(router, module, arch_name)
    options = router_options(
        arch_name,
        module,
        name,
        top_k=top_k,
        normalize=norm_topk_prob,
        default_normalize=arch.default_normalize,
    )
    if jitter_noise is None:
        jitter = getattr(module, "jitter_noise", 0.0) or 0.0
    elif (
        isinstance(jitter_noise, bool)
        or not isinstance(jitter_noise, int | float)
        or not 0 <= jitter_noise < 1
    ):
        raise MoEConfigError(
            f"{arch_name}: jitter_noise is {jitter_noise!r}.\n"
            "jitter_noise must be a number in [0, 1).\n"
            "Fix: set jitter_noise: 0.01 (say), or 0 for none."
        )
    else:
        jitter = float(jitter_noise)
    group = _ep_group(arch_name, ep_mesh, experts.num_experts)
    dispatcher = TokenDispatcher(experts.num_experts, group, capacity_factor=capacity)
    return ExpertParallelMoE(
        arch,
        module,
        experts=experts,
        router=(name, adapter),
        options=options,
        dispatcher=dispatcher,
        jitter_noise=jitter,
    )
