"""A small torchtitan-layout Llama whose attention calls SDPA, for tests/test_sdpa_strategies.py.

Module names follow torchtitan (``tok_embeddings``, ``layers.N.attention.wq/wk/wv/wo``,
``feed_forward.w1/w2/w3``, ``attention_norm``, ``ffn_norm``, ``norm``, ``output``) so that
hp's planner recognizes the roles; attention transposes q, k, v to ``[B, H, L, D]`` and calls
``F.scaled_dot_product_attention(..., is_causal=True)``, which on CPU is the flash kernel.
The factories are module level: the equivalence check's ranks import them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hp_core.runtime.dtensor_strategies import FLASH_CPU
from tests.dist_tasks_sdpa import DTensorOps

VOCAB, DIM, HEADS, LAYERS, FFN, SEQ = 48, 32, 4, 2, 48, 8
MAX_SEQ = 64  # the verifier runs a longer sequence than the batches
HEAD_DIM = DIM // HEADS


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on ``[B, L, H, D]``: pairs (i, i + D/2) turn by the angle."""
    first, second = x.chunk(2, dim=-1)
    turned = torch.cat((-second, first), dim=-1)
    return x * cos[None, :, None, :] + turned * sin[None, :, None, :]


class Attention(nn.Module):
    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.gqa = kv_heads != HEADS
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(DIM, kv_heads * HEAD_DIM, bias=False)
        self.wv = nn.Linear(DIM, kv_heads * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = _rotate(self.wq(x).view(b, n, -1, HEAD_DIM), cos, sin).transpose(1, 2)
        k = _rotate(self.wk(x).view(b, n, -1, HEAD_DIM), cos, sin).transpose(1, 2)
        v = self.wv(x).view(b, n, -1, HEAD_DIM).transpose(1, 2)
        # GQA: k and v keep their fewer heads; the kernel maps the q heads onto them.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)
        return self.wo(y.transpose(1, 2).reshape(b, n, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU


class Block(nn.Module):
    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM, eps=1e-6)
        self.attention = Attention(kv_heads)
        self.ffn_norm = nn.RMSNorm(DIM, eps=1e-6)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class SdpaLlama(nn.Module):
    """Returns the logits tensor; :func:`next_token_loss` is its loss."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, kv_heads: int = HEADS) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block(kv_heads) for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM, eps=1e-6)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        half = torch.arange(HEAD_DIM // 2, dtype=torch.float32)
        angles = torch.outer(
            torch.arange(MAX_SEQ, dtype=torch.float32), 10000.0 ** (-2 * half / HEAD_DIM)
        )
        self.register_buffer("cos", angles.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", angles.sin().repeat(1, 2), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        h = self.tok_embeddings(input_ids)
        for layer in self.layers.values():
            h = layer(h, self.cos[:n], self.sin[:n])
        return self.output(self.norm(h))


def _seeded(model: nn.Module) -> nn.Module:
    """Non-trivial weights: the norms' too (ones would hide a misplaced norm weight)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    return model


def llama() -> nn.Module:
    return _seeded(SdpaLlama())


def llama_gqa() -> nn.Module:
    """Two k/v heads for four q heads: one k/v head per rank at tp=2."""
    return _seeded(SdpaLlama(kv_heads=2))


def batch(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(100 + step)
    return {"input_ids": torch.randint(0, VOCAB, (2, SEQ), generator=gen)}


def next_token_loss(logits: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    ids = batch["input_ids"]
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def require_flash_on_dtensors(model: nn.Module, mode: str) -> None:
    """``after_apply``: in validate mode, layer 0's attention must run the CPU flash kernel on
    DTensors (not the math path, not local tensors), or its forward raises; so a passing
    equivalence check cannot be one that never met hp's strategies."""
    if mode != "validate":
        return
    attention = model.get_submodule("layers.0.attention")
    attention.__dict__["forward"] = FlashSpy(attention.forward)


class FlashSpy:
    """Calls ``fn`` and raises unless the CPU flash kernel ran on DTensors inside it."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with DTensorOps() as ops:
            out = self.fn(*args, **kwargs)
        if str(FLASH_CPU) not in ops.seen:
            raise RuntimeError(f"{FLASH_CPU} did not run on DTensors; ops seen: {ops.seen}")
        return out
