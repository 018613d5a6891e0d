"""Hand-written toy modules for layouts that no transformers 5.24 model has.

- ``HeadAttention``: an attention with ``num_heads`` / ``num_key_value_heads`` / ``head_dim``
  attributes (older HF versions and many custom models keep head counts on the module);
- ``ListMoE``: the per-expert ``nn.ModuleList`` MoE layout (``experts[i].w1/w2/w3`` plus a
  ``gate`` router Linear), as in older Mixtral;
- ``FusedQKVAttention``: a phi3-style fused ``qkv_proj``;
- ``ToyCausalLM``: a Llama-shaped causal LM assembled from those pieces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hp_core.testing.external_models import NanoGPT

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
VOCAB = 128


class HeadAttention(nn.Module):
    """GQA attention that divides its head counts by tp (what ``_tp_local_attr_plan`` is for)."""

    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS, kv_heads: int = KV_HEADS) -> None:
        super().__init__()
        self.num_heads = heads
        self.num_key_value_heads = kv_heads
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = (
            self.k_proj(hidden_states)
            .view(b, s, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        v = (
            self.v_proj(hidden_states)
            .view(b, s, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        rep = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class FusedQKVAttention(nn.Module):
    """Phi3-style attention: one ``qkv_proj`` whose rows are [q; k; v]."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)
        return self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ListMoE(nn.Module):
    """Top-k routed MoE with one module per expert (the older Mixtral layout)."""

    def __init__(
        self, hidden: int = HIDDEN, inter: int = 32, experts: int = 4, top_k: int = 2
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList([Expert(hidden, inter) for _ in range(experts)])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, chosen = torch.topk(self.gate(x).softmax(-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows, slot = (chosen == i).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return out.view_as(hidden_states)


class MLP(nn.Module):
    def __init__(self, hidden: int = HIDDEN, inter: int = 128) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, attn: nn.Module, ffn: nn.Module, ffn_name: str) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(HIDDEN)
        self.self_attn = attn
        self.post_attention_layernorm = nn.RMSNorm(HIDDEN)
        self.ffn_name = ffn_name
        setattr(self, ffn_name, ffn)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states))
        return h + getattr(self, self.ffn_name)(self.post_attention_layernorm(h))


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


class ToyCausalLM(nn.Module):
    """The module tree of a toy causal LM.

    ``model.embed_tokens / model.layers.N.{self_attn, mlp|block_sparse_moe, norms} / lm_head``
    """

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.model = Backbone(layers)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))


def head_attention_lm(
    n_layers: int = 2, heads: int = HEADS, kv_heads: int = KV_HEADS
) -> ToyCausalLM:
    return ToyCausalLM(
        [
            Layer(HeadAttention(heads=heads, kv_heads=kv_heads), MLP(), "mlp")
            for _ in range(n_layers)
        ]
    )


def list_moe_lm(n_layers: int = 2, experts: int = 4) -> ToyCausalLM:
    return ToyCausalLM(
        [
            Layer(HeadAttention(), ListMoE(experts=experts), "block_sparse_moe")
            for _ in range(n_layers)
        ]
    )


def fused_qkv_lm(n_layers: int = 1) -> ToyCausalLM:
    return ToyCausalLM([Layer(FusedQKVAttention(), MLP(), "mlp") for _ in range(n_layers)])


class WithStrayParameter(nn.Module):
    """A Llama-shaped toy whose ``model`` holds a parameter no role rule knows."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = head_attention_lm(1)
        self.inner.model.register_parameter("mystery_scale", nn.Parameter(torch.ones(HIDDEN)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids)


class FusedMLP(nn.Module):
    """Phi3-style MLP: one ``gate_up_proj`` whose rows are [gate; up]."""

    def __init__(self, hidden: int = HIDDEN, inter: int = 128) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def fused_mlp_lm(n_layers: int = 1) -> ToyCausalLM:
    return ToyCausalLM([Layer(HeadAttention(), FusedMLP(), "mlp") for _ in range(n_layers)])


class DropoutMLP(MLP):
    """Dropout on the rowwise projection's output *inside* the block: on a partial sum under tp."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(super().forward(x))


def dropout_mlp_lm(p: float = 0.1) -> ToyCausalLM:
    return ToyCausalLM([Layer(HeadAttention(), DropoutMLP(p), "mlp")])


class LocalWidthAttention(HeadAttention):
    """Reshapes with a width it keeps under its own attribute name, which no plan divides."""

    def __init__(self) -> None:
        super().__init__()
        self.inner_width = HIDDEN

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, _ = hidden_states.shape
        v = self.v_proj(hidden_states).repeat_interleave(HEADS // KV_HEADS, dim=-1)
        return self.o_proj(v.reshape(b, s, self.inner_width))


def local_width_lm() -> ToyCausalLM:
    return ToyCausalLM([Layer(LocalWidthAttention(), MLP(), "mlp")])


class PositionEmbeddingLM(ToyCausalLM):
    """A learned position embedding used by the model's own code, outside every block (GPT-2's
    wpe)."""

    def __init__(self, n_layers: int = 1) -> None:
        super().__init__([Layer(HeadAttention(), MLP(), "mlp") for _ in range(n_layers)])
        self.wpe = nn.Embedding(64, HIDDEN)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids) + self.wpe(
            torch.arange(input_ids.shape[1], device=input_ids.device)
        )
        for layer in self.model.layers:
            h = layer(h)
        return self.lm_head(self.model.norm(h))


class HeadCountReader(ToyCausalLM):
    """Model code that reads a head count the plan divides in production (it then fails there)."""

    def __init__(self) -> None:
        super().__init__([Layer(HeadAttention(), MLP(), "mlp")])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model(input_ids)
        heads = self.model.layers[0].self_attn.num_heads
        return self.lm_head(h + torch.zeros(heads * HEAD_DIM, device=h.device))


class DrawingAttention(HeadAttention):
    """Records one ``torch.rand`` draw per call, from inside its (tp-sharded) region."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[torch.Tensor] = []

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.draws.append(torch.rand(4))
        return super().forward(hidden_states)


def drawing_lm() -> ToyCausalLM:
    return ToyCausalLM([Layer(DrawingAttention(), MLP(), "mlp")])


class LearnedActivationMLP(MLP):
    """A Swish with a learned slope inside the MLP: its parameter meets sharded features."""

    def __init__(self) -> None:
        super().__init__()
        self.beta = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_proj(x)
        return self.down_proj(h * torch.sigmoid(self.beta * h) * self.up_proj(x))


def learned_activation_lm() -> ToyCausalLM:
    return ToyCausalLM([Layer(HeadAttention(), LearnedActivationMLP(), "mlp")])


class OneHeadAttention(nn.Module):
    """nanoGPT's fused ``c_attn`` attending with one head: no view splits q, k or v into
    heads, so nothing (module, config or forward) says where tp could cut whole heads."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(x.shape[-1], dim=2)
        return self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class OneHeadNanoGPT(NanoGPT):
    """``hp_core.testing.external_models.NanoGPT`` with one-head attention: its fused q/k/v
    is refused (the role report's and the CLI's refusal case)."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.transformer["h"].children():
            block.attn = OneHeadAttention(block.attn.c_proj.in_features)
