"""The bad and good forwards of docs/shardable-forwards.md (imported by the gloo ranks too).

Each example is an attention or MLP module; ``net(name)`` puts it between an embedding and
a head so that hp plans it as one tensor-parallel block. The doc shows these classes'
source verbatim (``tests/test_shardable_forwards.py`` checks it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, VOCAB = 32, 4, 64


class HardCodedHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads = HEADS
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(DIM, DIM) for _ in range(3))
        self.o_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, 4, 8).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, 32))


class LocalHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(DIM, DIM) for _ in range(3))
        self.o_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class ResidualInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(F.gelu(self.up_proj(x)))


class ResidualOutside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class RawBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = nn.Linear(DIM, 4 * DIM)
        self.down_proj = nn.Linear(4 * DIM, DIM, bias=False)
        self.out_bias = nn.Parameter(torch.zeros(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x))) + self.out_bias


class UnknownHeadCount(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = HEADS
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(DIM, DIM) for _ in range(3))
        self.o_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class PerHeadGrid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(DIM, DIM) for _ in range(3))
        self.o_proj = nn.Linear(DIM, DIM)
        self.gain = nn.Parameter(torch.ones(1, HEADS, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True) * self.gain
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class PerHeadVector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.head_dim = HEADS, DIM // HEADS
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(DIM, DIM) for _ in range(3))
        self.o_proj = nn.Linear(DIM, DIM)
        self.gain = nn.Parameter(torch.ones(HEADS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True) * self.gain.view(1, -1, 1, 1)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


EXAMPLES = {
    c.__name__: c
    for c in (
        HardCodedHeads,
        LocalHeads,
        UnknownHeadCount,
        ResidualInside,
        ResidualOutside,
        RawBias,
        PerHeadGrid,
        PerHeadVector,
    )
}


class Layer(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(self.norm(x))


class Net(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Layer(block)])
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def seeded_net(make_block: Callable[[], nn.Module]) -> Net:
    """``Net`` around ``make_block()``, seeded, its weights perturbed off their init (so
    every rank builds the same non-trivial weights)."""
    torch.manual_seed(0)
    model = Net(make_block())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def net(name: str) -> Net:
    """The seeded net around example ``name``."""
    return seeded_net(EXAMPLES[name])


def batch(step: int) -> dict[str, torch.Tensor]:
    return {"ids": torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(step))}


def loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["ids"][:, 1:].flatten())


def factory(name: str) -> str:
    """The ``"module:function"`` path of a zero-argument factory of ``net(name)``."""
    return f"tests.forward_examples:{name}_net"


def __getattr__(name: str) -> object:
    """``<Example>_net``: the zero-argument factory of ``net("<Example>")``."""
    example = name.removesuffix("_net")
    if name.endswith("_net") and example in EXAMPLES:
        return functools.partial(net, example)
    raise AttributeError(name)
