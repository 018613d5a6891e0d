"""A GPT written the way nanoGPT writes it (hp's own code, nanoGPT's design).

What a nanoGPT user's model looks like to hp:

* ``GPTConfig`` dataclass; attention with one fused ``c_attn`` (q, k, v side by side,
  each ``n_embd`` wide) split by ``self.n_embd``; head views built from the *input*
  width ``C`` and ``self.n_head`` (``C // self.n_head``), and the merge back to ``C``;
* the flash path: ``F.scaled_dot_product_attention(..., is_causal=True)``;
* ``self.transformer = nn.ModuleDict(dict(wte, wpe, drop, h, ln_f))`` with ``lm_head``
  tied to ``wte``;
* ``forward(idx, targets=None) -> (logits, loss)``: without targets only the last
  position's logits (the generation path), with targets the full logits and the
  cross-entropy (``ignore_index=-1``). Training calls ``model(X, Y)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 96
SEQ = 16
BATCH = 2


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    """A LayerNorm whose bias is optional (nanoGPT's ``bias=False`` configs drop it)."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError("n_embd must be a multiple of n_head")
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # nanoGPT keeps a slow masked-softmax fallback for old torch; every torch hp
        # supports has SDPA, so this zoo entry always takes the flash path.
        self.flash = hasattr(F, "scaled_dot_product_attention")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # The head width comes from the input width C, not from a stored head_dim.
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: the embedding *is* the output projection's Parameter.
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that write into the residual stream.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, t = idx.size()
        if t > self.config.block_size:
            raise ValueError(f"sequence of {t} is longer than block_size {self.config.block_size}")
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
            return logits, loss
        # Inference-time shortcut: only the last position's logits (a list index keeps
        # the time dimension).
        return self.lm_head(x[:, [-1], :]), None


def tiny() -> GPT:
    """A seeded two-layer GPT: vocab 96, width 64, 4 heads, biases on."""
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=32, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=64)
    return GPT(cfg)


def batch(seed: int) -> dict[str, Any]:
    """``model(X, Y)``: the inputs and the next tokens (nanoGPT's get_batch)."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return {"idx": data[:, :-1].contiguous(), "targets": data[:, 1:].contiguous()}


def output_loss(output: Any, batch: dict[str, Any]) -> torch.Tensor:
    """The loss the model computed itself: the second element of ``(logits, loss)``."""
    loss: torch.Tensor = output[1]
    return loss


def loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The one-device training call: ``logits, loss = model(X, Y)``."""
    return output_loss(model(**batch), batch)
