"""A GPT written the way minGPT writes it (hp's own code, minGPT's design).

What a minGPT user's model looks like to hp:

* ``GPT.get_default_config()`` returns a ``CfgNode`` (an attribute bag) with either a
  ``model_type`` or explicit ``n_layer``/``n_head``/``n_embd``, plus the three dropouts;
* attention with a fused ``c_attn`` split by ``self.n_embd``, head views from the input
  width ``C // self.n_head``, a registered ``bias`` buffer holding the causal mask
  (``tril`` viewed ``[1, 1, block_size, block_size]``) and the explicit softmax
  attention (``q @ k.transpose(-2, -1)``, ``masked_fill``, ``softmax``, ``att @ v``);
* each ``Block``'s MLP is an ``nn.ModuleDict(dict(c_fc, c_proj, act, dropout))`` run by a
  lambda ``self.mlpf`` that closes over that ModuleDict (so a ``copy.deepcopy`` of the
  model keeps calling the *original* MLP: functions deep-copy as themselves);
* ``forward(idx, targets=None) -> (logits, loss)`` with the full logits always.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 96
SEQ = 16
BATCH = 2


class CfgNode:
    """An attribute bag, like minGPT's ``mingpt.utils.CfgNode``."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)

    def merge_from_dict(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return "CfgNode(" + ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items()) + ")"


class NewGELU(nn.Module):
    """The tanh approximation of GELU, written out as minGPT (and BERT, GPT-2) do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: CfgNode) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError("n_embd must be a multiple of n_head")
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        # The causal mask, registered as a buffer (named "bias" for historical reasons).
        size = config.block_size
        self.register_buffer("bias", torch.tril(torch.ones(size, size)).view(1, 1, size, size))
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, config: CfgNode) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.ModuleDict(
            dict(
                c_fc=nn.Linear(config.n_embd, 4 * config.n_embd),
                c_proj=nn.Linear(4 * config.n_embd, config.n_embd),
                act=NewGELU(),
                dropout=nn.Dropout(config.resid_pdrop),
            )
        )
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlpf(self.ln_2(x))


class GPT(nn.Module):
    @staticmethod
    def get_default_config() -> CfgNode:
        return CfgNode(
            model_type="gpt",
            n_layer=None,
            n_head=None,
            n_embd=None,
            vocab_size=None,
            block_size=None,
            embd_pdrop=0.1,
            resid_pdrop=0.1,
            attn_pdrop=0.1,
        )

    #: The named sizes (a subset of minGPT's table).
    MODEL_TYPES: dict[str, dict[str, int]] = {
        "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
        "gopher-44m": dict(n_layer=8, n_head=16, n_embd=512),
        "gpt-mini": dict(n_layer=6, n_head=6, n_embd=192),
        "gpt-micro": dict(n_layer=4, n_head=4, n_embd=128),
        "gpt-nano": dict(n_layer=3, n_head=3, n_embd=48),
    }

    def __init__(self, config: CfgNode) -> None:
        super().__init__()
        if config.vocab_size is None or config.block_size is None:
            raise ValueError("config needs vocab_size and block_size")
        self.block_size = config.block_size
        type_given = config.model_type is not None
        params_given = all(getattr(config, k) is not None for k in ("n_layer", "n_head", "n_embd"))
        if type_given == params_given:
            raise ValueError("give exactly one of model_type or (n_layer, n_head, n_embd)")
        if type_given:
            config.merge_from_dict(self.MODEL_TYPES[config.model_type])
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.embd_pdrop),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # not tied
        self.apply(self._init_weights)
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
        elif isinstance(module, nn.LayerNorm):
            nn.init.zeros_(module.bias)
            nn.init.ones_(module.weight)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, t = idx.size()
        if t > self.block_size:
            raise ValueError(f"sequence of {t} is longer than block_size {self.block_size}")
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device).unsqueeze(0)  # (1, t)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        return logits, loss


def tiny() -> GPT:
    """A seeded two-layer GPT (explicit sizes: minGPT's named types have odd head counts)."""
    torch.manual_seed(0)
    config = GPT.get_default_config()
    config.merge_from_dict(
        dict(
            model_type=None, n_layer=2, n_head=4, n_embd=48, vocab_size=VOCAB, block_size=32,
            embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0,
        )
    )  # fmt: skip
    return GPT(config)


def _run_mlp(m: nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
    return m.dropout(m.c_proj(m.act(m.c_fc(x))))


def tiny_copyable() -> GPT:
    """:func:`tiny` with each block's ``mlpf`` lambda replaced by a ``partial`` over that
    block's MLP: ``copy.deepcopy`` copies a partial's arguments (so a copy calls its own
    MLP), while it keeps a lambda as is (so a copy of :func:`tiny` calls the original's)."""
    model = tiny()
    for block in model.transformer.h:
        block.mlpf = partial(_run_mlp, block.mlp)
    return model


def batch(seed: int) -> dict[str, Any]:
    """``model(x, y)``: minGPT's trainer passes the inputs and the next tokens."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return {"idx": data[:, :-1].contiguous(), "targets": data[:, 1:].contiguous()}


def output_loss(output: Any, batch: dict[str, Any]) -> torch.Tensor:
    """The loss the model computed itself: the second element of ``(logits, loss)``."""
    loss: torch.Tensor = output[1]
    return loss


def loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The one-device training call: ``logits, loss = model(x, y)``."""
    return output_loss(model(**batch), batch)
