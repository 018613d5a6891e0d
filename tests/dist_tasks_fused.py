"""Rank-side tasks of tests/test_fused_projections.py: fused projections on tp, end to end.

``match`` trains the single-device model, the production and the validate copy side by
side (2 AdamW steps) and reports the worst differences of loss, logits, every gradient and
every weight after the steps, plus what the exports give back before training;
``contiguous_control`` is the same comparison for a plan whose fused layouts were dropped
(plain contiguous ``Shard`` of ``[Q; K; V]``), which must fail it; ``bad_descriptor``
applies a plan whose layout does not add up and reports the refusal and whether the model
was left as it was; ``roundtrip`` saves through every export path at tp=2 and loads back.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

import hp_core
from hp_core import HpError
from hp_core.testing.compare import allclose_excess, grads_excess
from hp_core.testing.families import build_family, family_batch
from hp_core.testing.fused import restore_fused
from hp_core.testing.gather import gather_full_grads
from hp_core.testing.probe import CollectiveCounter

STEPS = 2
RTOL = 1e-5


def _mesh(tp: int) -> Any:
    return init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        return float("inf")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _train(models: dict[str, Any], plan: Any, family: str, mesh: Any) -> dict[str, float]:
    opts = {
        k: torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-5, foreach=False)
        for k, m in models.items()
    }
    worst: dict[str, float] = {}
    ref = models["ref"]
    for step in range(STEPS):
        ids = family_batch(family, seed=step)
        res = {}
        for k, m in models.items():
            opts[k].zero_grad(set_to_none=True)
            out = m(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            grads = (
                {n: p.grad for n, p in m.named_parameters()}
                if k == "ref"
                else restore_fused(gather_full_grads(m, ref, mesh), plan, mesh.size())
            )
            res[k] = (out.loss.detach(), out.logits.detach(), grads)
        for k in ("prod", "val"):
            for what, i in (("loss", 0), ("logits", 1)):
                e = allclose_excess(res[k][i], res["ref"][i], rtol=RTOL)
                worst[f"{k}:{what}"] = max(worst.get(f"{k}:{what}", 0.0), e)
            e = grads_excess(res[k][2], res["ref"][2], rtol=RTOL)
            worst[f"{k}:grad"] = max(worst.get(f"{k}:grad", 0.0), e)
        for opt in opts.values():
            opt.step()
    whole = {k: v.detach() for k, v in ref.state_dict().items()}
    for k in ("prod", "val"):
        worst[f"{k}:weights"] = _worst(hp_core.full_state_dict(models[k], rank0_only=False), whole)
    return worst


def match(family: str, tp: int, sp: bool, **config: Any) -> dict[str, Any]:
    """Both modes against one device; the export before training; the verifier's collectives."""
    mesh = _mesh(tp)
    base = build_family(family, seed=0, **config)
    plan = hp_core.plan(base, mesh, sequence_parallel=sp)
    with CollectiveCounter() as comm:
        report = hp_core.verify(base, plan, mesh)
    models = {k: copy.deepcopy(base) for k in ("ref", "prod", "val")}
    hp_core.apply(models["prod"], plan, mesh, verify=report)
    hp_core.apply(models["val"], plan, mesh, mode="validate", verify=report)
    saved = {k: v.detach().clone() for k, v in base.state_dict().items()}
    exported = {
        k: _worst(hp_core.full_state_dict(models[k], rank0_only=False), saved)
        for k in ("prod", "val")
    }
    fused = {fqn: dict(s._fused_layouts) for fqn, s in plan.items() if s._fused_layouts}
    attrs = {fqn: dict(s._tp_local_attr_plan or {}) for fqn, s in plan.items() if fused.get(fqn)}
    shared_config = models["prod"].config
    modules_config = {
        fqn: models["prod"].get_submodule(fqn).config is shared_config
        for fqn in fused
        if hasattr(models["prod"].get_submodule(fqn), "config")
    }
    worst = _train(models, plan, family, mesh)
    return {
        "excess": worst,
        "exported": exported,
        "collectives": comm.total(),
        "fused": fused,
        "attrs": attrs,
        "shares_config": modules_config,
        "global_heads": getattr(shared_config, "num_attention_heads", None),
        "explain": plan.explain(),
        "reductions": len(report.reductions),
    }


def contiguous_control(family: str) -> dict[str, Any]:
    """The plan with its fused layouts declared as one part: plain contiguous shards of
    ``[Q; K; V]`` and ``[gate; up]`` (head counts still made local)."""
    mesh = _mesh(2)
    base = build_family(family, seed=0)
    plan = hp_core.plan(base, mesh)
    for _, spec in plan.items():  # each layout declared as one part: nothing moves
        one = {
            rel: {
                **d,
                "kind": "interleaved",
                "parts": [sum(d["parts"])],
                "units": [2],
                "names": ["all"],
            }
            for rel, d in spec._fused_layouts.items()
        }
        spec.with_derived(fused_layouts=one)
    models = {k: copy.deepcopy(base) for k in ("ref", "prod", "val")}
    hp_core.apply(models["prod"], plan, mesh, verify=hp_core.verify(base, plan, mesh))
    hp_core.apply(
        models["val"], plan, mesh, mode="validate", verify=hp_core.verify(base, plan, mesh)
    )
    ids = family_batch(family, seed=0)
    with torch.no_grad():
        want = models["ref"](input_ids=ids, use_cache=False).logits
        return {
            k: float((models[k](input_ids=ids, use_cache=False).logits - want).abs().max())
            for k in ("prod", "val")
        }


def bad_descriptor(family: str, mode: str) -> dict[str, Any]:
    """A plan whose fused layout does not add up to the parameter: refused, model untouched."""
    mesh = _mesh(2)
    model = build_family(family, seed=0)
    plan = hp_core.plan(model, mesh)
    fqn, spec = next((f, s) for f, s in plan.items() if s._fused_layouts)
    rel, data = next(iter(spec._fused_layouts.items()))
    wrong = {**data, "parts": [data["parts"][0] + 16, *data["parts"][1:-1], data["parts"][-1] - 8]}
    spec.with_derived(fused_layouts={**spec._fused_layouts, rel: wrong})
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        hp_core.apply(model, plan, mesh, mode=mode)
    except HpError as e:
        after = model.state_dict()
        return {
            "type": type(e).__name__,
            "message": str(e),
            "where": f"{fqn}.{rel}",
            "untouched": all(torch.equal(before[k], after[k]) for k in before)
            and not hasattr(model, "_hp_applied"),
        }
    return {"type": None}


def roundtrip(family: str, root: str, mode: str, **config: Any) -> dict[str, Any]:
    """save_pretrained(full_state_dict) → from_pretrained in one process; DCP at tp=2 →
    one process and back; load_pretrained of a save_pretrained directory into a meta model."""
    mesh = _mesh(2)
    base = build_family(family, seed=0, **config)
    ids = family_batch(family, seed=3)
    with torch.no_grad():
        want = base(input_ids=ids, use_cache=False).logits
    saved = {k: v.detach().clone() for k, v in base.state_dict().items()}
    model = copy.deepcopy(base)
    hp_core.apply(model, hp_core.plan(model, mesh, sequence_parallel=False), mesh, mode=mode)
    full = hp_core.full_state_dict(model)  # rank 0 only
    out: dict[str, Any] = {}
    export_dir, dcp_dir, ref_dir = (os.path.join(root, f"{family}-{mode}-{x}") for x in "edr")
    if dist.get_rank() == 0:
        model_cls = type(base)
        base.save_pretrained(export_dir, state_dict=full)
        base.save_pretrained(ref_dir)
        again = model_cls.from_pretrained(export_dir)
        with torch.no_grad():
            out["from_pretrained"] = float((again(input_ids=ids).logits - want).abs().max())
    dcp.save(get_model_state_dict(model), checkpoint_id=dcp_dir)
    if dist.get_rank() == 0:
        whole = build_family(family, seed=1, **config)
        state = whole.state_dict()
        dcp.load(state, checkpoint_id=dcp_dir, no_dist=True)
        whole.load_state_dict(state)
        out["dcp_one_process"] = _worst(whole.state_dict(), saved)
    dist.barrier()
    meta = build_family(family, device="meta", **config)
    hp_core.apply(meta, hp_core.plan(meta, mesh, sequence_parallel=False), mesh, mode=mode)
    hp_core.load_pretrained(meta, ref_dir)
    with torch.no_grad():
        out["load_pretrained"] = float(
            (meta(input_ids=ids, use_cache=False).logits - want).abs().max()
        )
    # Back into the tp=2 model from its own DCP checkpoint, after perturbing it.
    with torch.no_grad():
        for p in meta.parameters():
            p.add_(0.5)
    _dcp_back(meta, dcp_dir)
    with torch.no_grad():
        out["dcp_back"] = float((meta(input_ids=ids, use_cache=False).logits - want).abs().max())
    return out


def _dcp_back(model: Any, path: str) -> None:
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)


def dcp_reshard(family: str, path: str, mode: str, **config: Any) -> float:
    """The DCP checkpoint ``roundtrip`` wrote at tp=2, loaded at this world's tp: logits."""
    mesh = _mesh(dist.get_world_size())
    base = build_family(family, seed=0, **config)
    ids = family_batch(family, seed=3)
    with torch.no_grad():
        want = base(input_ids=ids, use_cache=False).logits
    model = build_family(family, seed=1, **config)
    hp_core.apply(model, hp_core.plan(model, mesh, sequence_parallel=False), mesh, mode=mode)
    _dcp_back(model, path)
    with torch.no_grad():
        return float((model(input_ids=ids, use_cache=False).logits - want).abs().max())


def config_rollback(mode: str) -> dict[str, Any]:
    """A fault after the attribute phase: the attention's private config and head counts are
    undone, the model's shared config was never touched."""
    from tests.dist_tasks_faults import Fault

    mesh = _mesh(2)
    model = build_family("phi3", seed=0)
    plan = hp_core.plan(model, mesh)
    report = hp_core.verify(model, plan, mesh)
    attn = model.get_submodule("model.layers.0.self_attn")
    shared, kv = model.config, attn.num_key_value_heads
    raised = None
    try:
        with Fault("gradient reductions", "runtime"):
            hp_core.apply(model, plan, mesh, mode=mode, verify=report)
    except Exception as e:
        raised = type(e).__name__
    return {
        "raised": raised,
        "same_config": attn.config is shared,
        "heads": shared.num_attention_heads,
        "kv": attn.num_key_value_heads == kv,
        "marker": "_hp_private_config" in attn.__dict__,
    }


def _stepped(family: str, mesh: Any, mode: str | None, **config: Any) -> tuple[Any, Any]:
    model = build_family(family, seed=0, **config)
    if mode is not None:
        hp_core.apply(model, hp_core.plan(model, mesh), mesh, mode=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    ids = family_batch(family, seed=0)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    return model, opt


def _moments(model: Any, opt: Any, names: list[str]) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, opt)["state"]
    out = {}
    for n in names:
        v = state[n]["exp_avg"]
        out[n] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return out


def optimizer_roundtrip(family: str, path: str, mode: str, save: bool, **config: Any) -> float:
    """AdamW moments of the fused parameters: saved with DCP at this world's tp (``save``) or
    loaded there from such a checkpoint; the worst difference from one device's moments."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    mesh = _mesh(dist.get_world_size())
    ref, ref_opt = _stepped(family, mesh, None, **config)
    names = [n for n, _ in ref.named_parameters() if "qkv_proj" in n or "gate_up_proj" in n]
    want = {n: ref_opt.state[p]["exp_avg"] for n, p in ref.named_parameters() if n in names}
    model, opt = _stepped(family, mesh, mode, **config)
    if save:
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    else:
        with torch.no_grad():  # other moments until loaded
            for p in model.parameters():
                for v in opt.state[p].values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        v.add_(1.0)
        target = {"optim": get_optimizer_state_dict(model, opt)}
        dcp.load(target, checkpoint_id=path)
        set_optimizer_state_dict(model, opt, target["optim"])
    got = _moments(model, opt, names)
    return max(float((got[n] - want[n]).abs().max()) for n in names)
