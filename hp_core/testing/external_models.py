"""Tiny causal LMs written outside transformers, each with its own naming convention.

They are what a new user brings: a torchtitan-style Llama, a nanoGPT-style GPT (fused
``c_attn``), Megatron-style definitions (fused ``linear_qkv``, and a variant with
separate ``linear_q``/``linear_k``/``linear_v``), a Llama whose author chose their own
names, a hand-written GPT with learned positions and eager attention, and one whose
blocks hold their projections directly. None registers
anything with hp: the planner must read their structure. Every model takes
``forward(input_ids, labels=None, use_cache=None)`` and returns ``.loss`` / ``.logits``
like a transformers causal LM, so the differential matrix trains them unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EXTERNAL_MODELS", "VOCAB", "build_external", "external_batch"]

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, MAX_SEQ = 128, 64, 4, 2, 16, 128, 2, 64


@dataclasses.dataclass
class LMOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


def _lm_output(logits: torch.Tensor, labels: torch.Tensor | None) -> LMOutput:
    loss = None
    if labels is not None:
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1)
        )
    return LMOutput(logits, loss)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``[B, S, H, D]`` (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


class _Rotary(nn.Module):
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        t = torch.arange(MAX_SEQ).float()
        freqs = torch.cat([torch.outer(t, inv)] * 2, dim=-1)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)


# --------------------------------------------------------------------- torchtitan-style
class TitanAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = HEAD_DIM
        self.n_rep = HEADS // KV_HEADS
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        xq = _rope(self.wq(x).view(bs, seq, -1, self.head_dim), cos, sin)
        xk = _rope(self.wk(x).view(bs, seq, -1, self.head_dim), cos, sin)
        xv = self.wv(x).view(bs, seq, -1, self.head_dim)
        xk = xk.repeat_interleave(self.n_rep, dim=2)
        xv = xv.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class TitanFeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = TitanAttention()
        self.feed_forward = TitanFeedForward()
        self.attention_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanTransformer(nn.Module):
    """torchtitan's Llama layout: ``tok_embeddings``, ``layers``, ``norm``, ``output``."""

    def __init__(self, n_layers: int = LAYERS) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.rope = _Rotary(HEAD_DIM)
        self.layers = nn.ModuleDict({str(i): TitanBlock() for i in range(n_layers)})
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, use_cache: bool = False
    ) -> LMOutput:
        h = self.tok_embeddings(input_ids)
        seq = input_ids.shape[1]
        cos, sin = self.rope.cos[:seq], self.rope.sin[:seq]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return _lm_output(self.output(self.norm(h)), labels)


# --------------------------------------------------------------------- nanoGPT-style
class NanoAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(bs, seq, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(bs, seq, -1))


class NanoMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(DIM, 4 * DIM)
        self.c_proj = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.attn = NanoAttention()
        self.ln_2 = nn.LayerNorm(DIM)
        self.mlp = NanoMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's layout: ``transformer.{wte,wpe,h,ln_f}``, ``lm_head`` tied to ``wte``."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, DIM),
                "wpe": nn.Embedding(MAX_SEQ, DIM),
                "h": nn.ModuleList(NanoBlock() for _ in range(LAYERS)),
                "ln_f": nn.LayerNorm(DIM),
            }
        )
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = cast(nn.Embedding, self.transformer["wte"]).weight

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, use_cache: bool = False
    ) -> LMOutput:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.transformer["wte"](input_ids) + self.transformer["wpe"](pos)
        for block in self.transformer["h"].children():
            x = block(x)
        return _lm_output(self.lm_head(self.transformer["ln_f"](x)), labels)


# --------------------------------------------------------------------- Megatron-style
class MegatronAttention(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        if fused:
            self.linear_qkv = nn.Linear(DIM, 3 * HEADS * HEAD_DIM)
        else:
            self.linear_q = nn.Linear(DIM, HEADS * HEAD_DIM)
            self.linear_k = nn.Linear(DIM, HEADS * HEAD_DIM)
            self.linear_v = nn.Linear(DIM, HEADS * HEAD_DIM)
        self.linear_proj = nn.Linear(HEADS * HEAD_DIM, DIM)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        if self.fused:
            q, k, v = self.linear_qkv(x).chunk(3, dim=-1)
        else:
            q, k, v = self.linear_q(x), self.linear_k(x), self.linear_v(x)
        q, k, v = (t.view(bs, seq, -1, HEAD_DIM) for t in (q, k, v))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.linear_proj(y.transpose(1, 2).reshape(bs, seq, -1))


class MegatronMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(DIM, FFN)
        self.linear_fc2 = nn.Linear(FFN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class MegatronLayer(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(DIM)
        self.self_attention = MegatronAttention(fused)
        self.pre_mlp_layernorm = nn.LayerNorm(DIM)
        self.mlp = MegatronMLP()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class _MegatronDecoder(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MegatronLayer(fused) for _ in range(LAYERS))
        self.final_layernorm = nn.LayerNorm(DIM)


class _MegatronEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, DIM)


class MegatronGPT(nn.Module):
    """Megatron-core's names: ``embedding.word_embeddings``, ``decoder.layers.N.
    self_attention.linear_qkv`` (or separate q/k/v), ``mlp.linear_fc1/2``, ``output_layer``."""

    def __init__(self, fused: bool = True) -> None:
        super().__init__()
        self.embedding = _MegatronEmbedding()
        self.rope = _Rotary(HEAD_DIM)
        self.decoder = _MegatronDecoder(fused)
        self.output_layer = nn.Linear(DIM, VOCAB, bias=False)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, use_cache: bool = False
    ) -> LMOutput:
        x = self.embedding.word_embeddings(input_ids)
        seq = input_ids.shape[1]
        cos, sin = self.rope.cos[:seq], self.rope.sin[:seq]
        for layer in self.decoder.layers:
            x = layer(x, cos, sin)
        return _lm_output(self.output_layer(self.decoder.final_layernorm(x)), labels)


# --------------------------------------------------------------------- own names
class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.to_k = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.to_v = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.to_out = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        q, k, v = (f(x).view(bs, seq, -1, HEAD_DIM) for f in (self.to_q, self.to_k, self.to_v))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.to_out(y.transpose(1, 2).reshape(bs, seq, -1))


class GatedFFN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, FFN, bias=False)
        self.lift = nn.Linear(DIM, FFN, bias=False)
        self.drop = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(F.silu(self.gate(x)) * self.lift(x))


class OwnBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre_mix = RMSNorm(DIM)
        self.mix = Mixer()
        self.pre_ffn = RMSNorm(DIM)
        self.ffn = GatedFFN()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.pre_mix(x), cos, sin)
        return x + self.ffn(self.pre_ffn(x))


class OwnLlama(nn.Module):
    """A Llama whose author named everything their way (``embedder``, ``blocks``, ``mix``,
    ``to_q``, ``lift``/``drop``, ``unembed``); its RMSNorm's parameter is ``scale``."""

    def __init__(self) -> None:
        super().__init__()
        self.embedder = nn.Embedding(VOCAB, DIM)
        self.rope = _Rotary(HEAD_DIM)
        self.blocks = nn.ModuleList(OwnBlock() for _ in range(LAYERS))
        self.final = RMSNorm(DIM)
        self.unembed = nn.Linear(DIM, VOCAB, bias=False)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, use_cache: bool = False
    ) -> LMOutput:
        x = self.embedder(input_ids)
        seq = input_ids.shape[1]
        cos, sin = self.rope.cos[:seq], self.rope.sin[:seq]
        for block in self.blocks:
            x = block(x, cos, sin)
        return _lm_output(self.unembed(self.final(x)), labels)


# --------------------------------------------------------------------- hand-written GPT
class EagerSelfAttention(nn.Module):
    causal: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(DIM, DIM)
        self.key = nn.Linear(DIM, DIM)
        self.value = nn.Linear(DIM, DIM)
        self.merge = nn.Linear(DIM, DIM)
        mask = torch.tril(torch.ones(MAX_SEQ, MAX_SEQ, dtype=torch.bool))
        self.register_buffer("causal", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        q, k, v = (
            f(x).view(bs, seq, -1, HEAD_DIM).transpose(1, 2)
            for f in (self.query, self.key, self.value)
        )
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(~self.causal[:seq, :seq], float("-inf"))
        y = torch.matmul(scores.softmax(dim=-1), v)
        return self.merge(y.transpose(1, 2).reshape(bs, seq, -1))


class TinyGPTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm_a = nn.LayerNorm(DIM)
        self.sa = EagerSelfAttention()
        self.norm_b = nn.LayerNorm(DIM)
        self.expand = nn.Linear(DIM, FFN)
        self.contract = nn.Linear(FFN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.sa(self.norm_a(x))
        return x + self.contract(F.gelu(self.expand(self.norm_b(x))))


class TinyGPT(nn.Module):
    """Hand-written GPT: learned positions, eager attention (matmul, mask, softmax), and an
    MLP with no module of its own (``expand``/``contract`` sit in the block)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(MAX_SEQ, DIM)
        self.stack = nn.Sequential(*(TinyGPTBlock() for _ in range(LAYERS)))
        self.norm_out = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, use_cache: bool = False
    ) -> LMOutput:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.stack(self.tok(input_ids) + self.pos(pos))
        return _lm_output(self.head(self.norm_out(x)), labels)


# --------------------------------------------------------------------- flat blocks
class FlatBlock(nn.Module):
    """Everything in one module: norm, projections, attention and both residual adds."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.ln2 = nn.LayerNorm(DIM)
        self.i, self.j = nn.Linear(DIM, FFN), nn.Linear(FFN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        h = self.ln(x)
        q, k, v = (
            f(h).view(bs, seq, -1, HEAD_DIM).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(bs, seq, -1))
        return x + self.j(F.relu(self.i(self.ln2(x))))


class FlatGPT(nn.Module):
    """Blocks whose projections are direct children of the layer (no attention/MLP module):
    each Linear becomes a boundary of its own."""

    def __init__(self, n_layers: int = LAYERS) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(FlatBlock() for _ in range(n_layers))
        self.ln_out = nn.LayerNorm(DIM)
        self.proj_vocab = nn.Linear(DIM, VOCAB, bias=False)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, use_cache: bool = False
    ) -> LMOutput:
        x = self.wte(input_ids)
        for block in self.blocks:
            x = block(x)
        return _lm_output(self.proj_vocab(self.ln_out(x)), labels)


EXTERNAL_MODELS: dict[str, Callable[[], nn.Module]] = {
    "torchtitan_llama": TitanTransformer,
    "nanogpt": NanoGPT,
    "megatron_fused": lambda: MegatronGPT(fused=True),
    "megatron_split": lambda: MegatronGPT(fused=False),
    "own_llama": OwnLlama,
    "tiny_gpt": TinyGPT,
    "flat_gpt": FlatGPT,
}


def build_external(name: str, *, seed: int = 0, perturb: float = 0.02, **kwargs: int) -> nn.Module:
    """Model ``name`` of :data:`EXTERNAL_MODELS`, seeded, every float parameter perturbed (so
    biases and norm weights are non-trivial), in fp32 on the CPU."""
    torch.manual_seed(seed)
    model = EXTERNAL_MODELS[name](**kwargs) if kwargs else EXTERNAL_MODELS[name]()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(perturb * torch.randn(p.shape, generator=gen))
    return model


def external_batch(*, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    """Deterministic ``(batch, seq)`` input ids in ``[0, VOCAB)``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=gen)
