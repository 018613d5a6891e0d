"""Rank-side tasks: apply's preflight errors and its rollback (the model stays as it was)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import hp_core.runtime.install as R
from hp_core import plan as make_plan
from hp_core.apply import apply
from hp_core.injection import inner_wrapper, local_compute
from hp_core.mesh import MeshSpec
from hp_core.presets import build_model
from hp_core.verifier import verify
from tests._snapshots import differences, snapshot


@inner_wrapper
def identity_wrapper(target_module, ctx):
    return target_module.forward


@local_compute
def mismatched_compute(module, ctx):
    def compute(module, not_hidden_states):
        return not_hidden_states

    return compute


def undecorated(module, ctx):
    return None


def _tp_mesh() -> Any:
    return init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def _case(name: str, model: nn.Module) -> tuple[Any, Any, Any, str]:
    """(plan, mesh, model, mode) for one error case."""
    mesh = _tp_mesh()
    p = make_plan(model, mesh)
    mode = "production"
    attn = "model.layers.0.self_attn"
    if name == "mesh_missing_axis":
        p = make_plan(
            model,
            MeshSpec(("tp", "cp"), (2, 2)),
            overrides=[
                {
                    "match": "*.self_attn",
                    "inner_target": "self",
                    "inner_wrapper": identity_wrapper,
                    "region_dispatch": False,
                }
            ],
        )
    elif name == "mesh_size":
        p = make_plan(model, "tp=1")
    elif name == "not_a_mesh":
        mesh = MeshSpec(("tp",), (2,))
    elif name == "bad_mode":
        mode = "fast"
    elif name == "not_a_plan":
        p = {"model.embed_tokens": None}
    elif name == "unknown_module":
        p = make_plan(build_model("llama", num_hidden_layers=3), mesh)
    elif name == "divergent_plan":
        p = make_plan(model, mesh, sequence_parallel=dist.get_rank() == 0)
    elif name == "rank_local_failure":
        mode = "production" if dist.get_rank() == 0 else "fast"
    elif name == "region_dispatch_true":
        p[attn].region_dispatch = True
    elif name == "injection_without_region_dispatch":
        p[attn].inner_target, p[attn].inner_wrapper = "self", identity_wrapper
    elif name == "target_without_wrapper":
        p[attn].inner_target, p[attn].region_dispatch = "self", False
    elif name == "wrapper_without_target":
        p[attn].inner_wrapper, p[attn].region_dispatch = identity_wrapper, False
    elif name == "child_without_inner_out_src":
        p[attn].inner_target, p[attn].inner_wrapper, p[attn].region_dispatch = (
            "q_proj",
            identity_wrapper,
            False,
        )
    elif name == "child_typo":
        p[attn].inner_target, p[attn].inner_wrapper, p[attn].region_dispatch = (
            "q_prj",
            identity_wrapper,
            False,
        )
        p[attn].inner_out_src = "first_input"
    elif name == "unknown_wrapper_name":
        p[attn].inner_target, p[attn].inner_wrapper, p[attn].region_dispatch = (
            "self",
            "sdpa_hff",
            False,
        )
    elif name == "undecorated_compute":
        p["model.layers.0.mlp"].local_compute_fn, p["model.layers.0.mlp"].region_dispatch = (
            undecorated,
            False,
        )
    elif name == "compute_signature":
        p["model.layers.0.mlp"].local_compute_fn, p["model.layers.0.mlp"].region_dispatch = (
            mismatched_compute,
            False,
        )
    elif name == "cp_without_wrapper":
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        p = make_plan(model, mesh)
    elif name == "ep_without_compute":
        model = build_model("qwen2moe")
        p = make_plan(model, mesh, ep_size=2)
        for _, spec in p.items():  # as planned where no plugin registers a compute for it
            if spec._ep_size > 1:
                spec.local_compute_fn = None
    elif name == "attr_mismatch":
        p[attn]._tp_local_attr_plan = {"head_dim": (99, 49)}
    elif name == "loss_parallel_without_loss_function":
        model = _NoLossLM()
        p = make_plan(model, mesh, loss_parallel=True)
    elif name == "double_apply":
        apply(model, make_plan(model, mesh), mesh)
    else:  # pragma: no cover - a typo in the test itself
        raise KeyError(name)
    return p, mesh, model, mode


class _NoLossLM(nn.Module):
    """A model with an embedding and a head but no HF loss_function."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(128, 64)
        self.lm_head = nn.Linear(64, 128, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.embed_tokens(input_ids))


def apply_error(name: str) -> dict[str, Any]:
    """Run one failing apply; report the exception and whether the model stayed as it was."""
    model = build_model("llama")
    p, mesh, model, mode = _case(name, model)
    before = snapshot(model)
    try:
        apply(model, p, mesh, mode=mode)
    except Exception as e:
        return {
            "type": type(e).__name__,
            "mro": [c.__name__ for c in type(e).__mro__],
            "message": str(e),
            "untouched": not differences(before, snapshot(model)),
        }
    return {"type": None}


def _loss(model: nn.Module, ids: torch.Tensor) -> float:
    if hasattr(model, "config"):
        return float(model(input_ids=ids, labels=ids, use_cache=False).loss)
    return float(torch.nn.functional.cross_entropy(model(ids).reshape(-1, 128), ids.reshape(-1)))


def rollback(phase: str, mode: str) -> dict[str, Any]:
    """Make one phase of apply fail after it has mutated something; the model must be intact."""
    from tests._toy_models import head_attention_lm

    if phase == "attrs":
        torch.manual_seed(0)
        model = head_attention_lm()
    else:
        model = build_model("llama", attention_bias=True)
    mesh = _tp_mesh()
    overrides = None
    if phase == "inner":
        from tests.dist_tasks_inject import installs_in_place

        overrides = [
            {
                "match": "*.self_attn",
                "inner_target": "self",
                "inner_wrapper": installs_in_place,
                "region_dispatch": True,
            }
        ]
    p = make_plan(model, mesh, loss_parallel=phase == "loss", overrides=overrides)
    # Verified before the failure is injected: the verifier installs the plan on meta copies
    # with the same functions, and the failure is meant for the real install.
    report = verify(model, p, mesh)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    loss_before = _loss(model, ids)
    model.zero_grad(set_to_none=True)
    before = snapshot(model)
    saved: dict[str, Any] = {}

    def boom(*_a: Any, **_k: Any) -> None:
        raise RuntimeError(f"injected failure in {phase}")

    if phase == "params":
        original = R.shard_parameters

        def params_then_fail(*a: Any, **k: Any) -> Any:
            original(*a, **k)
            boom()

        saved["shard_parameters"] = R.shard_parameters
        R.shard_parameters = params_then_fail
    elif phase == "boundaries":
        original_bf = R.BoundaryForward
        count = {"n": 0}

        def third_fails(*a: Any, **k: Any) -> Any:
            count["n"] += 1
            if count["n"] == 3:
                boom()
            return original_bf(*a, **k)

        saved["BoundaryForward"] = R.BoundaryForward
        R.BoundaryForward = third_fails
    elif phase == "grad_sync":
        saved["GradReducer"] = R.GradReducer

        class FailingReducer:
            @staticmethod
            def build(*_a: Any, **_k: Any) -> None:
                boom()

        R.GradReducer = FailingReducer
    elif phase == "loss":
        saved["VocabParallelCausalLMLoss"] = R.VocabParallelCausalLMLoss
        original_loss = R.VocabParallelCausalLMLoss

        def loss_then_fail(*a: Any, **k: Any) -> Any:
            original_loss(*a, **k)
            boom()

        R.VocabParallelCausalLMLoss = loss_then_fail
    elif phase in ("final", "attrs", "inner"):
        original_set = R.Journal.set_attr
        seen = {"num_heads": 0}

        def fail_on_marker(self: Any, obj: Any, name: str, value: Any) -> None:
            if name == "num_heads":
                seen["num_heads"] += 1
            if name == "_hp_applied" or (phase == "attrs" and seen["num_heads"] == 2):
                boom()
            original_set(self, obj, name, value)

        saved["Journal.set_attr"] = original_set
        R.Journal.set_attr = fail_on_marker
    try:
        apply(model, p, mesh, mode=mode, verify=report)
        error = None
    except RuntimeError as e:
        error = str(e)
    finally:
        for key, value in saved.items():
            if key == "Journal.set_attr":
                R.Journal.set_attr = value
            else:
                setattr(R, key, value)
    untouched = not differences(before, snapshot(model))
    loss_after = _loss(model, ids)
    return {"error": error, "untouched": untouched, "same_loss": loss_after == loss_before}
