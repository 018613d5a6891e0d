"""A Llama written the way gpt-fast writes it (hp's own code, gpt-fast's design).

What a gpt-fast user's model looks like to hp:

* ``ModelArgs`` dataclass; ``n_local_heads`` is the number of *kv* heads (GQA), not a
  tp-local count;
* attention with one fused ``wqkv`` laid out ``[q | k | v]`` (q ``n_head * head_dim``
  wide, k and v ``n_local_heads * head_dim``), split by ``[self.dim, kv_size, kv_size]``
  and viewed with ``self.n_head`` / ``self.n_local_heads``; the merge views to
  ``self.dim``;
* rope from a real-valued ``freqs_cis`` cache, ``repeat_interleave`` for GQA, SDPA with an
  explicit boolean ``attn_mask``;
* ``Transformer.setup_caches(max_batch_size, max_seq_length)`` must run before any
  forward: it builds ``freqs_cis``, ``causal_mask`` (plain tensor attributes, as gpt-fast
  assigns them, not registered buffers) and one ``KVCache`` per layer;
* ``forward(idx, input_pos)`` *requires* ``input_pos``: it indexes
  ``self.causal_mask[None, None, input_pos]`` and ``self.freqs_cis[input_pos]``.

Training convention (gpt-fast is an inference project; this is the faithful way to train
it on one device): ``setup_caches(B, T)`` with ``T`` the training length (a multiple of 8,
so the mask is exactly ``T x T``), then :func:`disable_kv_caches` (``kv_cache = None`` on
every attention), then ``model(idx, input_pos=torch.arange(T))``. Keeping the caches does
not train: ``KVCache.update`` writes the step's k/v into the buffers in place, so the
buffer carries the step's autograd history, and the next step's backward runs into the
previous step's freed graph ("Trying to backward through the graph a second time", checked
by :func:`cached_training_fails`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 96
SEQ = 16
BATCH = 2


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass
class ModelArgs:
    block_size: int = 2048
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: int | None = None
    n_local_heads: int = -1
    head_dim: int = 64
    rope_base: float = 10000
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = find_multiple(int(2 * (4 * self.dim) / 3), 256)
        self.head_dim = self.dim // self.n_head


class KVCache(nn.Module):
    def __init__(
        self, max_batch_size: int, max_seq_length: int, n_heads: int, head_dim: int, dtype: Any
    ) -> None:
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype))

    def update(
        self, input_pos: torch.Tensor, k_val: torch.Tensor, v_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # input_pos: [S]; k_val, v_val: [B, H, S, D]. Written in place, returned whole.
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val
        return k_out, v_out


def precompute_freqs_cis(seq_len: int, n_elem: int, base: float, dtype: Any) -> torch.Tensor:
    """``[seq_len, n_elem // 2, 2]``: cos and sin of each position's rotation angles."""
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: n_elem // 2].float() / n_elem))
    angles = torch.outer(torch.arange(seq_len, device=freqs.device), freqs)
    rot = torch.polar(torch.ones_like(angles), angles)
    return torch.stack([rot.real, rot.imag], dim=-1).to(dtype=dtype)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    # x: [B, S, H, D] with adjacent pairs rotated together; freqs_cis: [S, D // 2, 2].
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    rot = freqs_cis.view(1, pairs.size(1), 1, pairs.size(3), 2)
    out = torch.stack(
        [
            pairs[..., 0] * rot[..., 0] - pairs[..., 1] * rot[..., 1],
            pairs[..., 1] * rot[..., 0] + pairs[..., 0] * rot[..., 1],
        ],
        -1,
    )
    return out.flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x.float()).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        total_head_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, total_head_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.kv_cache: KVCache | None = None
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.n_local_heads = config.n_local_heads
        self.dim = config.dim

    def forward(
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        mask: torch.Tensor,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.kv_cache is not None:
            if input_pos is None:
                raise ValueError("a kv cache needs input_pos")
            k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        hidden = int(config.intermediate_size or 0)
        self.w1 = nn.Linear(config.dim, hidden, bias=False)
        self.w3 = nn.Linear(config.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(
        self, x: torch.Tensor, input_pos: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.freqs_cis: torch.Tensor | None = None
        self.causal_mask: torch.Tensor | None = None
        self.max_batch_size = -1
        self.max_seq_length = -1

    def setup_caches(self, max_batch_size: int, max_seq_length: int) -> None:
        if self.max_seq_length >= max_seq_length and self.max_batch_size >= max_batch_size:
            return
        head_dim = self.config.dim // self.config.n_head
        max_seq_length = find_multiple(max_seq_length, 8)
        self.max_seq_length, self.max_batch_size = max_seq_length, max_batch_size
        dtype = self.output.weight.dtype
        for b in self.layers:
            b.attention.kv_cache = KVCache(
                max_batch_size, max_seq_length, self.config.n_local_heads, head_dim, dtype
            )
        self.freqs_cis = precompute_freqs_cis(
            self.config.block_size, head_dim, self.config.rope_base, dtype
        )
        self.causal_mask = torch.tril(
            torch.ones(self.max_seq_length, self.max_seq_length, dtype=torch.bool)
        )

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        if self.freqs_cis is None or self.causal_mask is None:
            raise RuntimeError("Caches must be initialized first (call setup_caches)")
        mask = self.causal_mask[None, None, input_pos]
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, freqs_cis, mask)
        return self.output(self.norm(x))


def disable_kv_caches(model: Transformer) -> None:
    """The training convention: no kv cache, so k/v are this step's and nothing is written."""
    for layer in model.layers:
        layer.attention.kv_cache = None


def tiny(*, kv_caches: bool = False) -> Transformer:
    """A seeded two-layer Llama: vocab 96, width 64, 4 heads, 2 kv heads, set up for
    training at batch 2 x 16 (caches disabled unless ``kv_caches``)."""
    torch.manual_seed(0)
    cfg = ModelArgs(
        block_size=32, vocab_size=VOCAB, n_layer=2, n_head=4, dim=64, n_local_heads=2,
        intermediate_size=128,
    )  # fmt: skip
    model = Transformer(cfg)
    model.setup_caches(max_batch_size=BATCH, max_seq_length=SEQ)
    if not kv_caches:
        disable_kv_caches(model)
    return model


def batch(seed: int) -> dict[str, Any]:
    """``model(idx, input_pos=arange(T))`` plus the next tokens for the loss."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return {"idx": data[:, :-1].contiguous(), "input_pos": torch.arange(SEQ)}


def output_loss(output: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    """Next-token cross-entropy of the logits against the batch's own shifted ids."""
    ids = batch["idx"]
    logits = output[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The one-device training call."""
    return output_loss(model(**batch), batch)


def cached_training_fails() -> str:
    """Train two steps *with* the kv caches on one device; returns the error it raises."""
    model = tiny(kv_caches=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        for step in range(2):
            opt.zero_grad()
            loss(model, batch(step)).backward()
            opt.step()
    except RuntimeError as e:
        return str(e).splitlines()[0]
    raise AssertionError("training with in-place kv caches unexpectedly worked")
