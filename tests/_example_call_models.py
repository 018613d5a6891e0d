"""Models whose forward is not ``forward(ids)`` (importable by the spawned ranks).

``TargetsLM`` branches on an optional argument as nanoGPT does: without ``targets`` it
computes the last position's logits only. ``PositionsLM`` needs ``input_pos`` as gpt-fast
does, reading its position table and causal mask (buffers ``setup_caches`` builds) at those
positions. The attention reads ``self.n_head`` and views by ``-1`` (hp makes the count local).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, SEQ = 64, 32, 4, 8


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_head = HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            w(x).view(b, t, self.n_head, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.fc, self.proj = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class TargetsLM(nn.Module):
    """``forward(idx, targets=None) -> (logits, loss)``; without targets, the last position."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.h = nn.ModuleList(Block() for _ in range(2))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class PositionsLM(nn.Module):
    """``forward(idx, input_pos)``: positions index buffers built by ``setup_caches``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def setup_caches(self, max_seq_length: int) -> None:
        angle = torch.arange(max_seq_length)[:, None] / (1 + torch.arange(DIM))[None, :]
        self.register_buffer("pos_table", 0.1 * torch.sin(angle), persistent=False)
        causal = torch.ones(max_seq_length, max_seq_length, dtype=torch.bool).tril()
        self.register_buffer("causal_mask", causal, persistent=False)

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        mask = self.causal_mask[None, None, input_pos][..., : idx.shape[1]]
        x = self.tok(idx) + self.pos_table[input_pos]
        for layer in self.layers:
            x = layer(x, mask)
        return self.output(self.norm(x))


def _seeded(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def targets_lm() -> nn.Module:
    torch.manual_seed(0)
    return _seeded(TargetsLM())


def positions_lm() -> nn.Module:
    torch.manual_seed(0)
    model = PositionsLM()
    model.setup_caches(SEQ)
    return _seeded(model)


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(step))


def targets_batch(step: int) -> dict[str, torch.Tensor]:
    ids = _ids(step)
    return {"idx": ids, "targets": ids.roll(-1, 1)}


def targets_loss(output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return output[1]


def positions_batch(step: int) -> dict[str, torch.Tensor]:
    return {"idx": _ids(step), "input_pos": torch.arange(SEQ)}


def positions_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = batch["idx"]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


class TableBlock(Block):
    """A layer that adds a table of the whole sequence to its input (a sequence shard under
    sequence parallelism does not fit it; the unsharded model runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", 0.1 * torch.ones(SEQ, DIM), persistent=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x + self.table, mask)


class TableLM(TargetsLM):
    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList(TableBlock() for _ in range(2))


def table_lm() -> nn.Module:
    torch.manual_seed(0)
    return _seeded(TableLM())


_CALLS = [0]


def drifting_lm() -> nn.Module:
    """A factory that seeds itself differently on every call (what the check refuses)."""
    _CALLS[0] += 1
    torch.manual_seed(_CALLS[0])
    return _seeded(TargetsLM())
