"""Models whose refusals print a fix, for checking that the printed fix holds.

:class:`PositionTableGPT` is nanoGPT with its learned position table held as a bare
parameter of the model (``self.pos_emb[:t]``, as ViT-style and many hand-written models do)
instead of an ``nn.Embedding``: no template claims it, so planning is refused with a fix. The
fix that keeps it whole without wrapping anything plans, but under sequence parallelism the
whole table meets a sequence shard of the token embeddings: hp must not print it alone.

:class:`MixedGPT` puts a module of bare parameters between two blocks, on the residual
stream: :class:`TokenAffine` works on each token alone, so the fix that makes it a boundary
on the sequence shards holds; :class:`RunningMean` mixes along the sequence, so that fix must
not be printed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.zoo import nanogpt


def _head(
    model: nanogpt.GPT, x: torch.Tensor, targets: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """nanoGPT's final norm, logits and (with targets) loss."""
    logits = model.lm_head(model.transformer.ln_f(x))
    if targets is None:
        return logits, None
    return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


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
        return _head(self, x, targets)


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


class TokenAffine(nn.Module):
    """A learned per-channel gain and shift, applied to each token alone (as a model-level
    adapter, a residual rescale between blocks): no template claims it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(width))
        self.shift = nn.Parameter(0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain + self.shift


class RunningMean(TokenAffine):
    """The same parameters, mixing along the sequence: each token gets the mean of the tokens
    before it (a causal pooling). On a sequence shard that mean would miss the tokens on the
    other ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seen = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)
        return x * self.gain + self.shift * (torch.cumsum(x, dim=1) / seen[:, None])


class MixedGPT(nanogpt.GPT):
    """nanoGPT with ``transformer.mix`` between its first and second block."""

    def __init__(self, config: nanogpt.GPTConfig, mix: type[TokenAffine]) -> None:
        super().__init__(config)
        self.transformer.mix = mix(config.n_embd)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for i, block in enumerate(self.transformer.h):
            x = self.transformer.mix(x) if i == 1 else x
            x = block(x)
        return _head(self, x, targets)


def _mixed(mix: type[TokenAffine]) -> MixedGPT:
    torch.manual_seed(0)
    cfg = nanogpt.GPTConfig(block_size=32, vocab_size=nanogpt.VOCAB, n_layer=2, n_head=4, n_embd=64)
    return MixedGPT(cfg, mix)


def token_affine_gpt() -> MixedGPT:
    """Seeded: :class:`MixedGPT` with a :class:`TokenAffine` between its blocks."""
    return _mixed(TokenAffine)


def running_mean_gpt() -> MixedGPT:
    """Seeded: :class:`MixedGPT` with a :class:`RunningMean` between its blocks."""
    return _mixed(RunningMean)
