"""Rank-side tasks behind the claims of docs/injection-contracts.md (spawned gloo ranks).

Each task applies a tiny model with a probe injection and returns what the probe saw: the
kind of tensor (``DTensor`` or ``Tensor``) and the shape of the parameters and inputs, at
the moment hp called the wrapper or factory and at each forward call.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from hp_plugin_moe.factories import qwen2moe
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import hp_core
from hp_core.injection import inner_wrapper, local_compute
from hp_core.testing import build_model

ATTN = "model.layers.0.self_attn"
MOE = "model.layers.0.mlp"
SEEN: list[dict[str, Any]] = []


def _kind(t: Any) -> str:
    return "DTensor" if isinstance(t, DTensor) else type(t).__name__


def _look(when: str, weight: torch.Tensor, x: Any = None) -> None:
    row: dict[str, Any] = {
        "when": when,
        "weight": _kind(weight),
        "shape": tuple(weight.shape),
        "device": weight.device.type,
    }
    if isinstance(weight, DTensor):
        row["local_shape"] = tuple(weight.to_local().shape)
    if x is not None:
        row["input"] = _kind(x)
    SEEN.append(row)


@inner_wrapper
def probe_wrapper(target_module, ctx):  # type: ignore[no-untyped-def]
    """Records what it receives, then runs the module's own forward."""
    _look("wrap", target_module.q_proj.weight)
    SEEN[-1]["tp_size"] = ctx.size("tp")
    original = target_module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else kwargs["hidden_states"]
        _look("call", target_module.q_proj.weight, x)
        return original(*args, **kwargs)

    return forward


def wrapper_sees(mode: str, region_dispatch: bool) -> list[dict[str, Any]]:
    """A tp=2 Qwen2-MoE whose first attention is wrapped by ``probe_wrapper``."""
    SEEN.clear()
    model = build_model("qwen2moe")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    plan = hp_core.plan(model, mesh)
    plan[ATTN].inner_target, plan[ATTN].inner_wrapper = "self", probe_wrapper
    plan[ATTN].region_dispatch = region_dispatch
    hp_core.apply(model, plan, mesh, mode=mode)
    model(torch.randint(3, 64, (2, 8)))
    return list(SEEN)


@local_compute
def probe_factory(module, ctx):  # type: ignore[no-untyped-def]
    """Records the expert weights it is bound with, then delegates to hp-plugin-moe."""
    _look("factory", module.experts.gate_up_proj)
    SEEN[-1]["ep_mesh"] = None if ctx.ep_mesh is None else tuple(ctx.ep_mesh.shape)
    compute = qwen2moe(module=module, ctx=ctx)

    def run(module: Any, hidden_states: torch.Tensor) -> Any:
        _look("call", module.experts.gate_up_proj, hidden_states)
        return compute(module, hidden_states)

    return run


def factory_sees(mode: str) -> dict[str, Any]:
    """A tp=2 Qwen2-MoE planned with ep_size=2, the first MoE block's compute probed; and
    the loss against one device."""
    SEEN.clear()
    ref = build_model("qwen2moe")
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    plan = hp_core.plan(model, mesh, ep_size=2)
    plan[MOE].local_compute_fn, plan[MOE].region_dispatch = probe_factory, False
    before = len(SEEN)
    hp_core.apply(model, plan, mesh, mode=mode)
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = model(ids, labels=ids).loss
    want = ref(ids, labels=ids).loss
    return {
        "before_apply": before,
        "seen": list(SEEN),
        "loss_diff": float((loss - want).abs().detach()),
    }
