"""Hand-written attention blocks whose head counts hp finds by proof (issue 23 item 2).

Each reads its head counts where real hand-written models do, under names hp has no list
for: a plain config object the block holds (litgpt-style, ``self.config.n_head``), an
attribute under another name (gpt-fast-style, ``n_local_heads`` is the kv-head count and
``dim`` the query width), or the input's own width (nanoGPT-style, ``B, T, C = x.size()``).
Each is placed in ``tests.forward_examples.Net`` (importable by the spawned ranks).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from hp_core.planner import head_search
from hp_core.testing import equivalence_on_rank
from tests import forward_examples as fe
from tests.forward_examples import DIM, Net

HEADS, GROUPS, HEAD_DIM = 4, 2, 8


@dataclasses.dataclass
class GptConfig:
    """A plain dataclass config (not a transformers one): the block reads it in its forward."""

    n_embd: int = DIM
    n_head: int = HEADS
    n_query_groups: int = GROUPS
    head_size: int = HEAD_DIM
    block_size: int = 16
    bias: bool = True


class ConfigAttention(nn.Module):
    """litgpt-style: counts on ``self.config``; a fused ``attn`` with its grouped layout (per
    query group: its q heads, one k, one v) or separate ``q``/``k``/``v`` projections."""

    def __init__(self, config: GptConfig, fused: bool) -> None:
        super().__init__()
        self.config = config
        self.fused = fused
        c = config
        kv = c.n_query_groups * c.head_size
        if fused:
            self.attn = nn.Linear(c.n_embd, c.n_head * c.head_size + 2 * kv)
        else:
            self.q = nn.Linear(c.n_embd, c.n_head * c.head_size)
            self.k, self.v = nn.Linear(c.n_embd, kv), nn.Linear(c.n_embd, kv)
        self.proj = nn.Linear(c.n_head * c.head_size, c.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.size()
        c = self.config
        per_group = c.n_head // c.n_query_groups
        if self.fused:
            qkv = self.attn(x).view(b, t, c.n_query_groups, per_group + 2, c.head_size)
            qkv = qkv.permute(0, 2, 3, 1, 4)  # (b, groups, per_group + 2, t, hs)
            q, k, v = qkv.split((per_group, 1, 1), dim=2)
            q = q.reshape(b, c.n_head, t, c.head_size)
            k = k.expand(-1, -1, per_group, -1, -1).reshape(b, c.n_head, t, c.head_size)
            v = v.expand(-1, -1, per_group, -1, -1).reshape(b, c.n_head, t, c.head_size)
        else:
            q = self.q(x).view(b, t, c.n_head, c.head_size).transpose(1, 2)
            k = self.k(x).view(b, t, c.n_query_groups, c.head_size).transpose(1, 2)
            v = self.v(x).view(b, t, c.n_query_groups, c.head_size).transpose(1, 2)
            k = k.repeat_interleave(per_group, dim=1)
            v = v.repeat_interleave(per_group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c.head_size * c.n_head))


class OtherNames(nn.Module):
    """gpt-fast-style: ``n_local_heads`` counts the kv heads, ``dim`` is the query width; a
    fused ``wqkv`` split by widths, or separate ``wq``/``wk``/``wv``."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim, self.dim = HEADS, GROUPS, HEAD_DIM, DIM
        self.fused = fused
        kv = GROUPS * HEAD_DIM
        if fused:
            self.wqkv = nn.Linear(DIM, DIM + 2 * kv, bias=False)
        else:
            self.wq = nn.Linear(DIM, DIM, bias=False)
            self.wk, self.wv = nn.Linear(DIM, kv, bias=False), nn.Linear(DIM, kv, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        if self.fused:
            q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim).transpose(1, 2)
        rep = self.n_head // self.n_local_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim))


class InputWidth(nn.Module):
    """nanoGPT-style: the width ``C`` comes from the input; a fused ``c_attn`` split by
    ``n_embd``, or separate ``c_q``/``c_k``/``c_v``."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.n_head, self.n_embd, self.fused = HEADS, DIM, fused
        if fused:
            self.c_attn = nn.Linear(DIM, 3 * DIM)
        else:
            self.c_q, self.c_k, self.c_v = (nn.Linear(DIM, DIM) for _ in range(3))
        self.c_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # the names nanoGPT's forward uses
        if self.fused:
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        else:
            q, k, v = self.c_q(x), self.c_k(x), self.c_v(x)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class ConstantHeads(nn.Module):
    """Views by a module constant: no attribute holds the count (``n_head`` is unused)."""

    def __init__(self) -> None:
        super().__init__()
        self.n_head = HEADS
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, HEADS, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


def constant_heads() -> Net:
    return fe.seeded_net(ConstantHeads)


def _config(fused: bool) -> Net:
    return fe.seeded_net(lambda: ConfigAttention(GptConfig(), fused))


def _names(fused: bool) -> Net:
    return fe.seeded_net(lambda: OtherNames(fused))


def _width(fused: bool) -> Net:
    return fe.seeded_net(lambda: InputWidth(fused))


config_split = functools.partial(_config, False)
config_fused = functools.partial(_config, True)
names_split = functools.partial(_names, False)
names_fused = functools.partial(_names, True)
width_split = functools.partial(_width, False)
width_fused = functools.partial(_width, True)

#: case -> the ``"module:function"`` factory the ranks import.
CASES = {
    name: f"tests._head_count_models:{name}"
    for name in (
        "config_split",
        "config_fused",
        "names_split",
        "names_fused",
        "width_split",
        "width_fused",
    )
}


def unsearched_equivalence(name: str, sequence_parallel: bool) -> dict[str, object]:
    """Rank task: case ``name`` planned with the search switched off (negative control): the
    worst errors, or the refusal's type."""
    search = head_search.search_local_attrs
    head_search.search_local_attrs = lambda *args, **kwargs: None
    try:
        report = equivalence_on_rank(
            globals()[name],
            fe.batch,
            "tp=2",
            loss_fn=fe.loss,
            plan_kwargs={"sequence_parallel": sequence_parallel},
            raise_on_failure=False,
        )
    except Exception as err:  # the refusal (or a loud failure) is the outcome
        return {"refused": type(err).__name__}
    finally:
        head_search.search_local_attrs = search
    return {**report.worst}
