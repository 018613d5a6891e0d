"""How the EP compute sees an MoE block: its router, routed experts and shared experts.

Found once, when a factory is bound (``describe_*`` functions only read the module);
the compute reads the weights by the same names on every call, so it sees the sharded
or stacked parameters that ``apply`` installed.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from hp_plugin_moe.errors import MoEInterfaceError, MoERuntimeError

__all__ = [
    "PER_EXPERT_NAMES",
    "ExpertWeights",
    "LocalExpertWeights",
    "describe_module",
    "find_experts",
    "find_router",
    "interface_error",
]

#: ``(gate, up, down)`` child names of one expert in the per-expert ``ModuleList`` layout.
PER_EXPERT_NAMES: tuple[tuple[str, str, str], ...] = (
    ("gate_proj", "up_proj", "down_proj"),
    ("w1", "w3", "w2"),
)


def describe_module(module: nn.Module, *, limit: int = 12) -> str:
    """Two lines listing the module's children and its parameters with their shapes."""
    children = ", ".join(f"{n} ({type(c).__name__})" for n, c in module.named_children()) or "none"
    params = [f"{n} {tuple(p.shape)}" for n, p in module.named_parameters()]
    more = f", ... and {len(params) - limit} more" if len(params) > limit else ""
    return f"  children: {children}\n  parameters: {', '.join(params[:limit]) or 'none'}{more}"


def interface_error(factory: str, module: nn.Module, problem: str, fix: str) -> MoEInterfaceError:
    """``MoEInterfaceError`` naming the factory and module class, listing what the module has."""
    return MoEInterfaceError(
        f"{factory} cannot drive {type(module).__name__}: {problem}\n"
        f"{type(module).__name__} has\n{describe_module(module)}\nFix: {fix}"
    )


def find_router(factory: str, module: nn.Module) -> tuple[str, nn.Module]:
    """The router child: ``gate`` (Hugging Face) or ``router``."""
    for name in ("gate", "router"):
        child = getattr(module, name, None)
        if isinstance(child, nn.Module):
            return name, child
    raise interface_error(
        factory,
        module,
        "it has no router child named 'gate' or 'router'.",
        "pass the MoE block itself (the module holding the router and the experts), or write a "
        "@local_compute factory for this layout.",
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter (validate mode) as its local tensor, differentiably."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


@dataclasses.dataclass(frozen=True)
class LocalExpertWeights:
    """This rank's expert weights for one call: SwiGLU ``down(act(gate(x)) * up(x))``."""

    gate_up: torch.Tensor | None  # batched [E, 2I, H]
    gate: torch.Tensor | None  # per-expert stacked [E, I, H]
    up: torch.Tensor | None
    down: torch.Tensor  # [E, H, I]
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
    act: Callable[[torch.Tensor], torch.Tensor]

    @property
    def num_local(self) -> int:
        return int(self.down.shape[0])

    def apply(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``j`` (local index) on the rows ``x``."""
        bg, bu, bd = self.biases
        if self.gate_up is not None:
            g, u = F.linear(x, self.gate_up[j]).chunk(2, dim=-1)
        else:
            # Without a fused gate_up, the constructor guarantees separate gate and up.
            gate, up = cast(torch.Tensor, self.gate), cast(torch.Tensor, self.up)
            g = F.linear(x, gate[j], None if bg is None else bg[j])
            u = F.linear(x, up[j], None if bu is None else bu[j])
        return F.linear(self.act(g) * u, self.down[j], None if bd is None else bd[j])


@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """Where a block keeps its routed experts, found when the factory is bound.

    ``batched``: ``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj [E, H, I]``
    (transformers 5.x). ``per_expert``: a ``ModuleList`` of experts with ``gate/up/down``
    Linears (``gate_proj/up_proj/down_proj`` or ``w1/w3/w2``); expert parallelism stacks
    them into ``experts.<name>.weight [E, ...]`` at apply.
    """

    kind: Literal["batched", "per_expert"]
    path: str
    num_experts: int
    names: tuple[str, str, str]  # batched: ("gate_up_proj", "", "down_proj")
    bias: bool
    act: Callable[[torch.Tensor], torch.Tensor]

    def local(self, module: nn.Module) -> LocalExpertWeights:
        """The weights this rank holds now (sharded, stacked, or the original ``ModuleList``)."""
        experts = getattr(module, self.path)
        if self.kind == "batched":
            return LocalExpertWeights(
                _local(getattr(experts, self.names[0])),
                None,
                None,
                _local(getattr(experts, self.names[2])),
                (None, None, None),
                self.act,
            )
        if isinstance(
            experts, nn.ModuleList
        ):  # not stacked: no expert parallelism, all experts here
            stacked = [torch.stack([getattr(e, n).weight for e in experts]) for n in self.names]
            bias = [
                torch.stack([getattr(e, n).bias for e in experts]) if self.bias else None
                for n in self.names
            ]
        else:
            try:
                stacked = [_local(getattr(experts, n).weight) for n in self.names]
                bias = [_local(getattr(experts, n).bias) if self.bias else None for n in self.names]
            except AttributeError:
                stacked_names = ", ".join(f"{self.path}.{n}.weight" for n in self.names)
                raise MoERuntimeError(
                    f"{type(module).__name__}.{self.path} is neither the per-expert ModuleList "
                    f"the factory was bound to nor its stacked form ({stacked_names}).\n"
                    "The experts must keep the structure the factory was bound to.\n"
                    "Fix: do not replace the experts after apply(); plan and apply the changed "
                    "model again instead."
                ) from None
        return LocalExpertWeights(
            None, stacked[0], stacked[1], stacked[2], (bias[0], bias[1], bias[2]), self.act
        )


def _activation(act: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    # An activation module runs once per local expert: call its forward directly, so module
    # hooks (e.g. CommDebugMode's tracker, which assumes one call per forward) see no repeats.
    if isinstance(act, nn.Module):
        return act.forward
    return act if callable(act) else F.silu


def find_experts(factory: str, module: nn.Module) -> ExpertWeights:
    """Recognise the routed experts of ``module`` (batched or per-expert layout)."""
    experts = getattr(module, "experts", None)
    if not isinstance(experts, nn.Module):
        raise interface_error(
            factory,
            module,
            "it has no 'experts' child.",
            "pass the MoE block that holds 'experts'.",
        )
    act = getattr(experts, "act_fn", None)
    if isinstance(experts, nn.ModuleList):
        if len(experts) == 0:
            raise interface_error(
                factory,
                module,
                "its 'experts' ModuleList is empty.",
                "give the block at least one expert.",
            )
        first = experts[0]
        for names in PER_EXPERT_NAMES:
            if all(isinstance(getattr(e, n, None), nn.Linear) for e in experts for n in names):
                bias = first._modules[names[0]].bias is not None  # type: ignore[union-attr]
                return ExpertWeights(
                    "per_expert",
                    "experts",
                    len(experts),
                    names,
                    bias,
                    _activation(getattr(first, "act_fn", None)),
                )
        options = " or ".join("/".join(n) for n in PER_EXPERT_NAMES)
        raise interface_error(
            factory,
            module,
            f"its experts are a ModuleList of {type(first).__name__}, which lacks SwiGLU Linears "
            f"named {options}.",
            "rename the expert projections, or write a @local_compute factory for this expert "
            "layout.",
        )
    own = dict(experts.named_parameters(recurse=False))
    gu, down = own.get("gate_up_proj"), own.get("down_proj")
    if gu is not None and down is not None and gu.dim() == 3 and down.dim() == 3:
        extra = sorted(set(own) - {"gate_up_proj", "down_proj"})
        if extra:
            raise interface_error(
                factory,
                module,
                f"its batched experts also hold {extra}, which this SwiGLU compute does not apply.",
                "write a @local_compute factory for this expert layout.",
            )
        return ExpertWeights(
            "batched",
            "experts",
            int(gu.shape[0]),
            ("gate_up_proj", "", "down_proj"),
            False,
            _activation(act),
        )
    raise interface_error(
        factory,
        module,
        f"its 'experts' ({type(experts).__name__}) is neither batched (3-D gate_up_proj and "
        "down_proj parameters) nor a ModuleList of per-expert SwiGLU modules.",
        "write a @local_compute factory for this expert layout.",
    )


def has_any(module: nn.Module, names: tuple[str, ...]) -> list[str]:
    """Which of ``names`` are child modules of ``module``."""
    return [n for n in names if isinstance(getattr(module, n, None), nn.Module)]


def forward_signature(module: nn.Module) -> inspect.Signature:
    """The forward's signature; its first parameter must be the hidden states, the rest optional."""
    sig = inspect.signature(module.forward)
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (
        params[0].POSITIONAL_ONLY,
        params[0].POSITIONAL_OR_KEYWORD,
    ):
        raise MoEInterfaceError(
            f"{type(module).__name__}.forward{inspect.signature(module.forward)} does not take "
            "the hidden states as its first positional parameter.\n"
            "The MoE compute needs forward(hidden_states, ...).\n"
            "Fix: write a @local_compute factory for this block's forward."
        )
    required = [
        p.name
        for p in params[1:]
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        raise MoEInterfaceError(
            f"{type(module).__name__}.forward takes required input(s) {required} besides "
            f"{params[0].name!r}.\n"
            "The MoE compute routes the hidden states only.\n"
            "Fix: write a @local_compute factory that uses them."
        )
    return sig
