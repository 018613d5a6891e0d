"""Models whose refusals print a fix, for checking that the printed fix holds.

:class:`PositionTableGPT` is nanoGPT with its learned position table held as a bare
parameter of the model (``self.pos_emb[:t]``, as ViT-style and many hand-written models do)
instead of an ``nn.Embedding``: no template claims it, so planning is refused with a fix. The
fix that keeps it whole without wrapping anything plans, but under sequence parallelism the
whole table meets a sequence shard of the token embeddings: hp must not print it alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.zoo import nanogpt


class PositionTableGPT(nanogpt.GPT):
    """nanoGPT whose position table is ``self.pos_emb``, an ``nn.Parameter``."""

    def __init__(self, config: nanogpt.GPTConfig) -> None:
        super().__init__(config)
        del self.transformer.wpe
        self.pos_emb = nn.Parameter(0.02 * torch.randn(config.block_size, config.n_embd))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, t = idx.size()
        x = self.transformer.drop(self.transformer.wte(idx) + self.pos_emb[:t])
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def position_table_gpt() -> PositionTableGPT:
    """Seeded: two layers, width 64, 4 heads, 32 positions."""
    torch.manual_seed(0)
    cfg = nanogpt.GPTConfig(block_size=32, vocab_size=nanogpt.VOCAB, n_layer=2, n_head=4, n_embd=64)
    return PositionTableGPT(cfg)


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, nanogpt.VOCAB, (2, 16), generator=g)
    return {"idx": idx, "targets": torch.roll(idx, -1, dims=1)}


def loss(output: tuple[torch.Tensor, torch.Tensor | None], _batch: object) -> torch.Tensor:
    """The loss the model returns next to its logits."""
    _logits, value = output
    if value is None:
        raise ValueError("the batch has no targets")
    return value
