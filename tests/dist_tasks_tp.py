"""Rank-side tasks for the tensor/sequence-parallel equivalence tests."""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

import hp_core
from hp_core.planner import plan as make_plan
from hp_core.runtime import apply
from hp_core.testing.compare import full_grads, full_tensor, max_abs_diff


def _tiny(family: str, **over):
    import transformers as T

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    base.update(over)
    cls_cfg, cls_model = {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
        "mistral": (T.MistralConfig, T.MistralForCausalLM),
    }[family]
    cfg = cls_cfg(**base)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls_model(cfg).float()


def tp_equivalence(family, mesh_shape, mesh_names, *, sp=True, mode="production", loss_parallel=False, steps=0, **over):
    model = _tiny(family, **over)
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 16))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=mesh_names)
    p = make_plan(model, mesh, sequence_parallel=sp, loss_parallel=loss_parallel)
    apply(model, p, mesh, mode=mode)
    r = ref(input_ids=ids, labels=ids, use_cache=False)
    r.loss.backward()
    o = model(input_ids=ids, labels=ids, use_cache=False)
    o.loss.backward()
    logits = o.logits
    if loss_parallel:
        logits = full_tensor(logits, {"tp": torch.distributed.tensor.Shard(2)}, mesh)
    out = {
        "loss": abs(float(o.loss) - float(r.loss)),
        "logits": float((logits - r.logits).abs().max()),
    }
    ref_grads = {n: q.grad for n, q in ref.named_parameters()}
    diffs = max_abs_diff(full_grads(model, mesh), ref_grads)
    out["grad"] = max(diffs.values())
    out["worst"] = max(diffs, key=diffs.get)
    return out


def debug_sp(mode="production"):
    model = _tiny("llama")
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 16))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    apply(model, make_plan(model, mesh), mesh, mode=mode)
    ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    st = model._hp_applied
    diffs = max_abs_diff(full_grads(model, mesh), {n: q.grad for n, q in ref.named_parameters()})
    return st.grad_sync.reductions, len(st.grad_sync.params), {k: v for k, v in diffs.items() if v > 1e-5}


def debug_sp2(mode="production"):
    model = _tiny("llama")
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 16))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    apply(model, make_plan(model, mesh), mesh, mode=mode)
    ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    g = full_grads(model, mesh)
    n = "model.norm.weight"
    r = dict(ref.named_parameters())[n].grad
    return (g[n] / r)[:8].tolist(), g[n][:4].tolist(), r[:4].tolist()
