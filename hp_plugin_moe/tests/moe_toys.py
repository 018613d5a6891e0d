"""Hand-written MoE modules for layouts no transformers 5.24 model has.

``PerExpertMoE`` keeps one module per expert in an ``nn.ModuleList`` (the layout of
older Mixtral / Qwen2-MoE releases and many custom models), which hp stacks into
``[E, ...]`` parameters when the experts are sharded. ``ToyMoELM`` is a causal LM of
such blocks with Hugging Face-style names (``model.layers.N.mlp``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, VOCAB = 64, 128


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class PerExpertMoE(nn.Module):
    """Top-k softmax router (a plain Linear ``gate``), renormalized, per-expert ModuleList."""

    def __init__(
        self,
        hidden: int = HIDDEN,
        inter: int = 32,
        experts: int = 4,
        top_k: int = 2,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = True
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList([Expert(hidden, inter, bias) for _ in range(experts)])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows, slot = (chosen == i).nonzero(as_tuple=True)
            out.index_add_(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return out.view_as(hidden_states)


class Layer(nn.Module):
    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.post_attention_layernorm = nn.RMSNorm(HIDDEN)
        self.mlp = moe

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Backbone(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(layers)
        self.norm = nn.RMSNorm(HIDDEN)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class ToyMoELM(nn.Module):
    """A toy MoE causal LM.

    ``model.embed_tokens / model.layers.N.{post_attention_layernorm, mlp} / model.norm / lm_head``
    """

    def __init__(self, layers: int = 2, experts: int = 4, bias: bool = False) -> None:
        super().__init__()
        self.model = Backbone(
            [Layer(PerExpertMoE(experts=experts, bias=bias)) for _ in range(layers)]
        )
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))


def toy_lm(seed: int = 0, **kw: int | bool) -> ToyMoELM:
    torch.manual_seed(seed)
    return ToyMoELM(**kw)  # type: ignore[arg-type]
