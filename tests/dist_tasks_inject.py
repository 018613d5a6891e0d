"""Rank-side tasks: injected compute and inner wrappers applied for real, under tp=2."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from hp_core import applied
from hp_core import plan as make_plan
from hp_core.apply import apply
from hp_core.injection import Target, inner_wrapper, local_compute
from hp_core.testing.compare import allclose_excess, gather_full_grads, max_abs_diff, nan_safe_max
from hp_core.testing.families import family_model


@local_compute
def local_mlp(module, ctx, scale=1.0):
    """A SwiGLU MLP on whatever (local) weights the module holds."""
    if ctx.tp_mesh is None or ctx.mesh is None:
        raise AssertionError("the framework must fill the active meshes")

    def compute(module, x):
        return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x)) * scale

    return compute


@inner_wrapper
def passthrough(target_module, ctx):
    original = target_module.forward

    def forward(*args, **kwargs):
        return original(*args, **kwargs)

    return forward


@inner_wrapper
def functional_linear(target_module, ctx):
    def forward(input):
        return F.linear(input, target_module.weight, target_module.bias)

    return forward


@inner_wrapper
def installs_in_place(target_module, ctx):
    original = target_module.forward

    def forward(*args, **kwargs):
        return original(*args, **kwargs)

    target_module.forward = forward


@inner_wrapper
def forgets_to_install(target_module, ctx):
    return None


def _run(overrides: list[dict], mode: str, *, register: bool = False) -> dict[str, Any]:
    if register:
        from hp_core.plugins import COMPUTE_FACTORY_REGISTRY, register_compute_factory

        if "test_local_mlp" not in COMPUTE_FACTORY_REGISTRY:
            register_compute_factory("test_local_mlp", local_mlp)
    base = family_model("llama")  # seeded noise on every weight (norms are not all one)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    p = make_plan(model, mesh, overrides=overrides)
    apply(model, p, mesh, mode=mode)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    r = ref(input_ids=ids, labels=ids, use_cache=False)
    r.loss.backward()
    o = model(input_ids=ids, labels=ids, use_cache=False)
    o.loss.backward()
    # Gathered without hp's placement tables; every fold NaN-safe (a NaN or shape mismatch is inf).
    diffs = max_abs_diff(
        gather_full_grads(model, ref, mesh),
        {n: q.grad for n, q in ref.named_parameters() if q.grad is not None},
    )
    resolved = {fqn: (w.wrapper, w.target) for fqn, w in applied(model).inner_wraps.items()}
    return {
        "loss": allclose_excess(o.loss.detach(), r.loss.detach(), rtol=0.0),
        "logits": allclose_excess(o.logits.detach(), r.logits.detach(), rtol=0.0),
        "grad": nan_safe_max(diffs.values()),
        "n_grads": len(diffs),
        "resolved": resolved,
    }


def injected(case: str, mode: str) -> dict[str, Any]:
    attn = "*.self_attn"
    try:
        if case == "local_compute_by_name":
            return _run(
                [
                    {
                        "match": "*.mlp",
                        "local_compute_fn": {"_target_": "test_local_mlp", "scale": 1.0},
                        "region_dispatch": False,
                    }
                ],
                mode,
                register=True,
            )
        if case == "local_compute_dispatching":
            return _run(
                [{"match": "*.mlp", "local_compute_fn": local_mlp, "region_dispatch": True}], mode
            )
        if case == "self_wrapper":
            return _run(
                [
                    {
                        "match": attn,
                        "inner_target": "self",
                        "inner_wrapper": passthrough,
                        "region_dispatch": True,
                    }
                ],
                mode,
            )
        if case == "self_wrapper_local":
            return _run(
                [
                    {
                        "match": attn,
                        "inner_target": "self",
                        "inner_wrapper": passthrough,
                        "region_dispatch": False,
                    }
                ],
                mode,
            )
        if case == "in_place_wrapper":
            return _run(
                [
                    {
                        "match": attn,
                        "inner_target": "self",
                        "inner_wrapper": installs_in_place,
                        "region_dispatch": True,
                    }
                ],
                mode,
            )
        if case == "child_wrapper":
            return _run(
                [
                    {
                        "match": attn,
                        "inner_target": "o_proj",
                        "inner_wrapper": functional_linear,
                        "region_dispatch": True,
                        "inner_out_src": {"tp": "partial"},
                    }
                ],
                mode,
            )
        if case == "child_wrapper_wrong_layout":
            return _run(
                [
                    {
                        "match": attn,
                        "inner_target": "o_proj",
                        "inner_wrapper": functional_linear,
                        "region_dispatch": True,
                        "inner_out_src": "first_input",
                    }
                ],
                mode,
            )
        if case == "wrong_out_src":
            return _run(
                [
                    {
                        "match": "model.layers.0.self_attn",
                        "out_src": {"attn_output": {"tp": "replicate"}},
                    }
                ],
                mode,
            )
        if case == "forgets_to_install":
            return _run(
                [
                    {
                        "match": attn,
                        "inner_target": "self",
                        "inner_wrapper": forgets_to_install,
                        "region_dispatch": True,
                    }
                ],
                mode,
            )
        if case == "target_config_typo":
            return _run(
                [
                    {
                        "match": "*.mlp",
                        "local_compute_fn": Target("test_local_mlp", {"scael": 2.0}),
                        "region_dispatch": False,
                    }
                ],
                mode,
                register=True,
            )
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "stage": getattr(e, "stage", None)}
    raise KeyError(case)
