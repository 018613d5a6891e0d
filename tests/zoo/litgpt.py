"""A GPT written the way litgpt writes it (hp's own code, litgpt's design), three configs.

Version reproduced: litgpt 0.4.x, whose fused ``attn`` is laid out *per query group*: each
group's ``n_head // n_query_groups`` query heads, then its key head, then its value head
(later releases use a plain ``[q | k | v]``). One ``Config`` is shared by every module
(``self.config``) and the attention forward reads ``self.config.n_head``,
``n_query_groups``, ``head_size``, ``rope_n_elem``: no head counts as module attributes.
The fused output is viewed ``(B, T, n_query_groups, q_per_kv + 2, head_size)``, permuted
and split per group; GQA by ``expand``; partial rotary on the first ``rope_n_elem``
channels; ``cos``/``sin`` buffers from ``build_rope_cache`` in the ``max_seq_length``
setter. ``Block`` has litgpt's residuals (sequential, parallel, parallel with one shared
norm: ``norm_2`` None); ``transformer = ModuleDict(dict(wte, h, ln_f))``, ``lm_head``;
``forward(idx, input_pos=None) -> logits``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Opt = Tensor | None  # an optional tensor argument

VOCAB, SEQ, BATCH = 96, 16, 2


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass
class Config:
    block_size: int = 4096
    vocab_size: int = 50254
    padding_multiple: int = 512
    padded_vocab_size: int | None = None
    n_layer: int = 16
    n_head: int = 32
    head_size: int | None = None
    n_embd: int = 4096
    rotary_percentage: float = 0.25
    parallel_residual: bool = True
    bias: bool = True
    lm_head_bias: bool = False
    n_query_groups: int | None = None
    shared_attention_norm: bool = False
    norm_class_name: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    norm_eps: float = 1e-5
    mlp_class_name: Literal["GptNeoxMLP", "LLaMAMLP"] = "GptNeoxMLP"
    gelu_approximate: str = "none"
    intermediate_size: int | None = None
    rope_base: int = 10000

    def __post_init__(self) -> None:
        self.head_size = self.head_size or self.n_embd // self.n_head
        mult = self.padding_multiple
        self.padded_vocab_size = self.padded_vocab_size or find_multiple(self.vocab_size, mult)
        self.n_query_groups = self.n_query_groups or self.n_head
        self.intermediate_size = self.intermediate_size or 4 * self.n_embd
        self.rope_n_elem = int(self.rotary_percentage * self.head_size)

    @property
    def mlp_class(self) -> type[nn.Module]:
        return {"GptNeoxMLP": GptNeoxMLP, "LLaMAMLP": LLaMAMLP}[self.mlp_class_name]

    @property
    def norm_class(self) -> type[nn.Module]:
        return RMSNorm if self.norm_class_name == "RMSNorm" else nn.LayerNorm


def build_rope_cache(
    seq_len: int, n_elem: int, device: torch.device | None = None, base: int = 10000
) -> tuple[Tensor, Tensor]:
    """``cos``, ``sin``: ``[seq_len, n_elem]``, each angle repeated for both halves."""
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, device=device).float() / n_elem))
    seq_idx = torch.arange(seq_len, device=device)
    idx_theta = torch.outer(seq_idx, theta).repeat(1, 2)
    return torch.cos(idx_theta), torch.sin(idx_theta)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # Rotate-half rope: the first half of the channels pairs with the second half.
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return ((x * cos) + (rotated * sin)).to(dtype=x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, dim: int = -1, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.dim = eps, dim

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        norm_x = torch.mean(xf * xf, dim=self.dim, keepdim=True)
        return (xf * torch.rsqrt(norm_x + self.eps) * self.weight.float()).to(dtype=x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        shape = (config.n_head + 2 * config.n_query_groups) * config.head_size
        self.attn = nn.Linear(config.n_embd, shape, bias=config.bias)  # q, k, v per group
        self.proj = nn.Linear(config.head_size * config.n_head, config.n_embd, bias=config.bias)
        self.config = config

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Opt = None, input_pos: Opt = None
    ) -> Tensor:
        B, T, _ = x.size()
        qkv = self.attn(x)
        q_per_kv = self.config.n_head // self.config.n_query_groups
        total_qkv = q_per_kv + 2  # each group: its query heads, one key, one value
        qkv = qkv.view(B, T, self.config.n_query_groups, total_qkv, self.config.head_size)
        qkv = qkv.permute(0, 2, 3, 1, 4)  # (B, n_query_groups, total_qkv, T, hs)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        if self.config.n_query_groups != self.config.n_head:
            # GQA/MQA: every query head of a group sees the group's one key and value.
            k = k.expand(B, self.config.n_query_groups, q_per_kv, T, self.config.head_size)
            v = v.expand(B, self.config.n_query_groups, q_per_kv, T, self.config.head_size)
        q = q.reshape(B, -1, T, self.config.head_size)  # (B, nh_q, T, hs)
        k = k.reshape(B, -1, T, self.config.head_size)
        v = v.reshape(B, -1, T, self.config.head_size)
        n = self.config.rope_n_elem
        q = torch.cat((apply_rope(q[..., :n], cos, sin), q[..., n:]), dim=-1)
        k = torch.cat((apply_rope(k[..., :n], cos, sin), k[..., n:]), dim=-1)
        y = self.scaled_dot_product_attention(q, k, v, mask)
        y = y.reshape(B, T, self.config.head_size * self.config.n_head)
        return self.proj(y)

    def scaled_dot_product_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Opt) -> Tensor:
        scale = 1.0 / math.sqrt(self.config.head_size)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale, is_causal=mask is None
        )
        return y.transpose(1, 2)


class GptNeoxMLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.config = config

    def forward(self, x: Tensor) -> Tensor:
        x = F.gelu(self.fc(x), approximate=self.config.gelu_approximate)
        return self.proj(x)


class LLaMAMLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.config = config

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        if not config.parallel_residual and config.shared_attention_norm:
            raise NotImplementedError("a shared attention norm needs parallel_residual")
        self.norm_1 = config.norm_class(config.n_embd, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config)
        norm_2 = config.norm_class(config.n_embd, eps=config.norm_eps)
        self.norm_2 = None if config.shared_attention_norm else norm_2
        self.mlp = config.mlp_class(config)
        self.config = config

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Opt = None, input_pos: Opt = None
    ) -> Tensor:
        x_normed = self.norm_1(x)
        attention_output = self.attn(x_normed, cos, sin, mask, input_pos)
        if self.config.parallel_residual:
            if self.norm_2 is not None:
                x_normed = self.norm_2(x)
            return self.mlp(x_normed) + attention_output + x
        x = attention_output + x
        return self.mlp(self.norm_2(x)) + x  # not shared: norm_2 exists


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=config.lm_head_bias)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=config.norm_class(config.n_embd, eps=config.norm_eps),
            )
        )
        self.max_seq_length = config.block_size

    @property
    def max_seq_length(self) -> int:
        return self._max_seq_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        if value > self.config.block_size:
            raise ValueError(f"max_seq_length {value} > block_size {self.config.block_size}")
        self._max_seq_length = value
        if not hasattr(self, "cos"):
            cos, sin = self.rope_cache()
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        elif value != self.cos.size(0):
            self.cos, self.sin = self.rope_cache(device=self.cos.device)

    def rope_cache(self, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
        cfg = self.config
        return build_rope_cache(self.max_seq_length, cfg.rope_n_elem, device, cfg.rope_base)

    def _init_weights(self, module: nn.Module) -> None:
        # litgpt's GPT-NeoX-style init, used as ``model.apply(model._init_weights)``.
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.normal_(module.bias, mean=0.0, std=0.02)  # non-trivial biases

    def forward(self, idx: Tensor, input_pos: Tensor | None = None) -> Tensor:
        T = idx.size(1)
        if self.max_seq_length < T:
            raise ValueError(f"sequence of {T} is longer than max_seq_length {self.max_seq_length}")
        if input_pos is not None:  # litgpt's generation path, with kv caches: left out
            raise NotImplementedError("input_pos needs kv caches; training passes none")
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin)
        return self.lm_head(self.transformer.ln_f(x))


#: litgpt-style named configs at tiny sizes (width 64, 4 heads of 16, 2 layers).
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(
        norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", n_query_groups=2, bias=False,
        parallel_residual=False, rotary_percentage=1.0, intermediate_size=128,
    ),
    "tiny-pythia": dict(
        norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", parallel_residual=True,
        shared_attention_norm=False, rotary_percentage=0.25, bias=True,
    ),
    "tiny-phi": dict(
        norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", parallel_residual=True,
        shared_attention_norm=True, rotary_percentage=0.4, bias=True, lm_head_bias=True,
        gelu_approximate="tanh",
    ),
}  # fmt: skip


def from_name(name: str) -> GPT:
    """A seeded GPT of one of :data:`CONFIGS`."""
    torch.manual_seed(0)
    cfg = Config(
        block_size=32, vocab_size=VOCAB, padding_multiple=32, n_layer=2, n_head=4,
        n_embd=64, **CONFIGS[name],
    )  # fmt: skip
    model = GPT(cfg)
    model.apply(model._init_weights)
    return model


#: The three named configs, built seeded: ``check_equivalence`` pickles these factories.
tiny_llama = partial(from_name, "tiny-llama")  # RMSNorm, LLaMAMLP, GQA, no bias, sequential
tiny_pythia = partial(from_name, "tiny-pythia")  # LayerNorm, GptNeoxMLP, parallel, rope 0.25
tiny_phi = partial(from_name, "tiny-phi")  # parallel with one shared norm, rope 0.4, tanh gelu


def batch(seed: int) -> dict[str, Any]:
    """``model(idx)``: the training call's keyword arguments."""
    gen = torch.Generator().manual_seed(seed)
    return {"idx": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)}


def output_loss(output: Tensor, batch: dict[str, Any]) -> Tensor:
    """litgpt's chunked_cross_entropy, unchunked: the logits against the next ids."""
    logits, targets = output[:, :-1], batch["idx"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def loss(model: nn.Module, batch: dict[str, Any]) -> Tensor:
    """The one-device training call: ``logits = model(input_ids)``, loss outside."""
    return output_loss(model(**batch), batch)
