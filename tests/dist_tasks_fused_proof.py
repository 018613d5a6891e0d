"""Rank-side tasks of tests/test_fused_proof.py: a toy fused attention, end to end on tp.

``ToyLM`` is embedding → layers of (norm, attention with one fused ``qkv_proj``, norm,
MLP) → norm → head. Its attention views the fused output as ``(groups, 3 * width)``:
``groups`` is the module's head-count attribute (tp makes it local), or a constant
(CodeGen's way), which a tp shard cannot follow; or (``"kv"``) it cuts ``[Q; K; V]`` in two
steps, ``q | kv`` then ``k | v``. ``match`` trains one device, production
and validate side by side and reports the worst differences.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import hp_core
from hp_core.testing.compare import allclose_excess, grads_excess
from hp_core.testing.fused import restore_fused
from hp_core.testing.gather import gather_full_grads

HIDDEN, HEADS, VOCAB = 32, 4, 64


class ToyAttention(nn.Module):
    def __init__(self, groups: int | str | None) -> None:
        super().__init__()
        self.num_heads = HEADS
        self.head_dim = HIDDEN // HEADS
        self.groups = groups  # None: one group per head (the head-count attribute)
        self.qkv_proj = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        groups = self.groups or self.num_heads
        if groups == "constant":  # hard-coded: no attribute holds the count
            groups = HEADS
        if groups == "data":  # a value-dependent group count: meta tensors have no values
            groups = int(torch.tensor(self.head_dim).to(x.device).tolist())
        if groups == "width":  # a constant width: the global 32, not the local 16
            parts = self.qkv_proj(x).split(HIDDEN, -1)
        elif groups == "transpose":  # moved before it is cut: hp reads no layout off that
            parts = self.qkv_proj(x).transpose(1, 2).transpose(1, 2).chunk(3, -1)
        elif groups == "kv":  # [Q; K; V] cut in two steps: q | kv, then kv into k | v
            width = self.num_heads * self.head_dim
            q, kv = self.qkv_proj(x).split([width, 2 * width], -1)
            parts = (q, *kv.chunk(2, -1))
        else:
            parts = self.qkv_proj(x).reshape(b, s, groups, -1).chunk(3, -1)
        q, k, v = (t.reshape(b, s, -1, self.head_dim).transpose(1, 2) for t in parts)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class ToyLayer(nn.Module):
    def __init__(self, groups: int | str | None) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attn = ToyAttention(groups)
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN)
        self.up_proj = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down_proj = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.down_proj(F.gelu(self.up_proj(self.post_attention_layernorm(x))))


class ToyLM(nn.Module):
    def __init__(self, groups: int | str | None = None, layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(ToyLayer(groups) for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def toy(groups: int | str | None = None) -> ToyLM:
    torch.manual_seed(0)
    return ToyLM(groups)


def match(groups: int | str | None) -> dict[str, Any]:
    """Logits and every gradient of both modes against one device (tp=2)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    base = toy(groups)
    plan = hp_core.plan(base, mesh, sequence_parallel=False)
    report = hp_core.verify(base, plan, mesh)
    models = {k: copy.deepcopy(base) for k in ("ref", "prod", "val")}
    hp_core.apply(models["prod"], plan, mesh, verify=report)
    hp_core.apply(models["val"], plan, mesh, mode="validate", verify=report)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    res = {}
    for k, m in models.items():
        logits = m(ids)
        logits.float().square().mean().backward()
        grads = (
            {n: p.grad for n, p in m.named_parameters()}
            if k == "ref"
            else restore_fused(gather_full_grads(m, models["ref"], mesh), plan, 2)
        )
        res[k] = (logits.detach(), grads)
    out: dict[str, Any] = {
        "fused": {f: dict(s._fused_layouts) for f, s in plan.items() if s._fused_layouts}
    }
    for k in ("prod", "val"):
        out[f"{k}:logits"] = allclose_excess(res[k][0], res["ref"][0], rtol=1e-5)
        out[f"{k}:grad"] = grads_excess(res[k][1], res["ref"][1], rtol=1e-5)
    return out
