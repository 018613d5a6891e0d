"""Rank-side tasks of the resume tests: model + AdamW state saved with DCP, resumed elsewhere.

A run is 6 AdamW steps on fixed batches. The interrupted runs save after step 3
(``get_model_state_dict`` + ``get_optimizer_state_dict`` + ``dcp.save``), and a fresh model
and optimizer (other seed) on another layout load the checkpoint
(``dcp.load`` + ``set_model_state_dict`` + ``set_optimizer_state_dict``) and run steps 4-6.
Every task returns the worst relative differences against the uninterrupted run.
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import hp_core
from hp_core.testing.families import build_family, family_batch
from hp_plugin_cp import enable_cp_loss, shard_batch_for_cp

LR = 1e-2
STEPS = 6
SAVE_AT = 3
#: A parameter sharded over tp (dim 0) and the vocab-parallel embedding: their moments.
MOMENT_KEYS = ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight")
CP_YAML = """
- match: "*.self_attn"
  when: cp
  inner_target: self
  inner_wrapper: sdpa_hf
  region_dispatch: false
"""
EP_YAML = """
overrides:
  - match: "model.layers.*.mlp"
    when: ep
    local_compute_fn: qwen2moe
    region_dispatch: false
"""

Batch = dict[str, torch.Tensor]


def _kv4() -> dict[str, Any]:
    return {"num_key_value_heads": 4}  # 4 kv heads: the tiny llama fits tp=2 and tp=4


def _build(family: str, seed: int) -> nn.Module:
    """fp64: AdamW divides by sqrt(exp_avg_sq), which turns fp32's reduction-order noise in
    near-zero gradients into 1e-3 relative parameter differences within 6 steps; in fp64
    sharded and single-device runs agree to ~1e-12, so a resume error cannot hide."""
    cfg = _kv4() if family == "llama" else {}
    return build_family(family, seed=seed, dtype=torch.float64, **cfg)


def _batches(family: str) -> list[Batch]:
    out = []
    for step in range(STEPS):
        ids = family_batch(family, batch=2, seq=16, seed=step)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: list[Batch],
    shard: Callable[[Batch], Batch] = lambda b: b,
) -> list[float]:
    losses = []
    for batch in batches:
        loss = model(**shard(batch), use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The worst ``max|a - b| / max|b|`` over the keys of ``b``."""
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in b)


def _loss_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _moments(
    model: nn.Module, opt: torch.optim.Optimizer, keys: tuple[str, ...] = MOMENT_KEYS
) -> dict[str, torch.Tensor]:
    """exp_avg / exp_avg_sq of the parameters ``keys``, as full tensors."""
    state = get_optimizer_state_dict(model, opt)["state"]
    return {
        f"{k}.{m}": (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k in keys
        for m in ("exp_avg", "exp_avg_sq")
        if isinstance(v := state[k][m], torch.Tensor)
    }


def _reference(family: str) -> dict[str, Any]:
    """The uninterrupted single-device run: losses, the moments at step 3, final params."""
    model = _build(family, 0)
    opt = _optimizer(model)
    batches = _batches(family)
    losses = _train(model, opt, batches[:SAVE_AT])
    moments = _moments(model, opt)
    losses += _train(model, opt, batches[SAVE_AT:])
    return {"losses": losses, "moments": moments, "params": _full(model.state_dict())}


def _tp_mesh(tp: int) -> DeviceMesh:
    return init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))


def _applied(family: str, seed: int, mesh: DeviceMesh, mode: str, **plan: Any) -> nn.Module:
    model = _build(family, seed)
    hp_core.apply(model, hp_core.plan(model, mesh, **plan), mesh, mode=mode)
    return model


def _save(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=path)


def _load(path: str, model: nn.Module, opt: torch.optim.Optimizer, **kw: Any) -> None:
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path, **kw)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _resumed(
    path: str,
    model: nn.Module,
    ref: dict[str, Any],
    family: str = "llama",
    shard: Callable[[Batch], Batch] = lambda b: b,
    save_to: str | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """Load ``path`` into ``model`` + a fresh AdamW (saved again to ``save_to`` if given),
    run steps 4-6 and compare with ``ref``."""
    opt = _optimizer(model)
    before = _rel(_moments(model, opt), ref["moments"])  # the fresh state: zeros
    _load(path, model, opt, **kw)
    if save_to is not None:
        _save(save_to, model, opt)
    moments = _rel(_moments(model, opt), ref["moments"])
    losses = _train(model, opt, _batches(family)[SAVE_AT:], shard)
    return {
        "moments_before": before,
        "moments": moments,
        "losses": _loss_rel(losses, ref["losses"][SAVE_AT:]),
        "params": _rel(_full(model.state_dict()), ref["params"]),
    }


def save_tp2(prod: str, val: str) -> dict[str, Any]:
    """Steps 1-3 at tp=2 in production (saved to ``prod``) and in validate (to ``val``); in
    production, scramble the optimizer state and load it back (the negative control)."""
    ref = _reference("llama")
    out: dict[str, Any] = {}
    for mode, path in (("production", prod), ("validate", val)):
        model = _applied("llama", 0, _tp_mesh(2), mode)
        opt = _optimizer(model)
        out[f"{mode}_losses"] = _loss_rel(
            _train(model, opt, _batches("llama")[:SAVE_AT]), ref["losses"][:SAVE_AT]
        )
        out[f"{mode}_moments"] = _rel(_moments(model, opt), ref["moments"])
        _save(path, model, opt)
    # Production's saved moments are DTensor views; scramble the optimizer, then restore it.
    osd = get_optimizer_state_dict(model, opt)
    out["saved_types"] = {type(osd["state"][k]["exp_avg"]).__name__ for k in MOMENT_KEYS}
    out["step_type"] = type(osd["state"][MOMENT_KEYS[0]]["step"]).__name__
    return out


def resume_at_tp(paths: list[str], tp: int, save_to: str | None) -> dict[str, Any]:
    """Resume each checkpoint in ``paths`` at ``tp`` (production); the first resumed model
    is saved again (at step 3) to ``save_to`` when given, for the next layout."""
    ref = _reference("llama")
    return {
        path: _resumed(
            path,
            _applied("llama", 1, _tp_mesh(tp), "production"),
            ref,
            save_to=save_to if path == paths[0] else None,
        )
        for path in paths
    }


def resume_one_process(path: str) -> dict[str, Any] | None:
    """Rank 0 alone: the checkpoint into a plain, unsharded model and a plain AdamW."""
    out = None
    if dist.get_rank() == 0:
        ref = _reference("llama")
        out = _resumed(path, _build("llama", 1), ref, no_dist=True)
    dist.barrier()
    return out


def save_cp_tp(path: str) -> dict[str, Any]:
    """Steps 1-3 at cp=2 x tp=2 (production, the CP override of docs/cp.md), saved."""
    ref = _reference("llama")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    model = _applied("llama", 0, mesh, "production", overrides=CP_YAML)
    enable_cp_loss(model, mesh["cp"])
    opt = _optimizer(model)
    losses = _train(
        model, opt, _batches("llama")[:SAVE_AT], lambda b: shard_batch_for_cp(b, mesh["cp"])
    )
    _save(path, model, opt)
    saved = get_optimizer_state_dict(model, opt)["state"][MOMENT_KEYS[0]]["exp_avg"]
    return {
        "losses": _loss_rel(losses, ref["losses"][:SAVE_AT]),
        "moments": _rel(_moments(model, opt), ref["moments"]),
        "mesh": tuple(saved.device_mesh.mesh_dim_names or ()),
    }


EXPERT_KEYS = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.self_attn.q_proj.weight")


def ep_resume(path: str) -> dict[str, Any]:
    """qwen2_moe at tp=2 with ep=2: an uninterrupted hp run against one saved after step 3
    and resumed by a fresh model and optimizer on the same layout."""
    plan = {"ep_size": 2, "overrides": EP_YAML}
    batches = _batches("qwen2_moe")
    whole = _applied("qwen2_moe", 0, _tp_mesh(2), "production", **plan)
    opt = _optimizer(whole)
    want = _train(whole, opt, batches[:SAVE_AT])
    want_moments = _moments(whole, opt, EXPERT_KEYS)
    want += _train(whole, opt, batches[SAVE_AT:])
    want_params = _full(whole.state_dict())

    first = _applied("qwen2_moe", 0, _tp_mesh(2), "production", **plan)
    opt = _optimizer(first)
    _train(first, opt, batches[:SAVE_AT])
    _save(path, first, opt)
    saved = get_optimizer_state_dict(first, opt)["state"][EXPERT_KEYS[0]]["exp_avg"]

    resumed = _applied("qwen2_moe", 1, _tp_mesh(2), "production", **plan)
    opt = _optimizer(resumed)
    before = _rel(_moments(resumed, opt, EXPERT_KEYS), want_moments)
    _load(path, resumed, opt)
    moments = _rel(_moments(resumed, opt, EXPERT_KEYS), want_moments)
    losses = _train(resumed, opt, batches[SAVE_AT:])
    return {
        "expert_mesh": tuple(saved.device_mesh.mesh_dim_names or ()),
        "moments_before": before,
        "moments": moments,
        "losses": _loss_rel(losses, want[SAVE_AT:]),
        "params": _rel(_full(resumed.state_dict()), want_params),
    }


def _error(call: Callable[[], object]) -> str | None:
    try:
        call()
    except hp_core.HpError as e:
        return f"{type(e).__name__}: {e}"
    return None


def refusals() -> dict[str, Any]:
    """Bad optimizer states are refused before anything loads; optimizers hp cannot lay
    out are refused on save; ``track_optimizer`` refuses an optimizer of another model."""
    model = _applied("llama", 0, _tp_mesh(2), "production")
    opt = _optimizer(model)
    _train(model, opt, _batches("llama")[:1])
    key = MOMENT_KEYS[0]
    before = _moments(model, opt)
    local = {p: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    bad = get_optimizer_state_dict(model, opt)
    bad["state"][key] = {**bad["state"][key], "exp_avg": torch.zeros(32, 64, dtype=torch.float64)}
    wrong_shape = _error(lambda: set_optimizer_state_dict(model, opt, bad))
    unchanged = _rel(_moments(model, opt), before)
    untouched = all(torch.equal(v, local[p][k]) for p, s in opt.state.items() for k, v in s.items())
    # A scrambled state really differs (the check below would catch a failed load) ...
    scrambled = get_optimizer_state_dict(model, opt)
    for entry in scrambled["state"].values():
        entry["exp_avg"] = entry["exp_avg"] + 1.0
    set_optimizer_state_dict(model, opt, scrambled)
    scrambled_diff = _rel(_moments(model, opt), before)

    try:  # a state dict of other parameter groups: torch's own check, untouched by hp's hook
        opt.load_state_dict({"state": {}, "param_groups": []})
        groups = None
    except ValueError as e:
        groups = str(e)

    adafactor = torch.optim.Adafactor(model.parameters(), lr=LR)
    model(**_batches("llama")[0], use_cache=False).loss.backward()
    adafactor.step()
    unshaped = _error(adafactor.state_dict)

    other = torch.optim.SGD(build_family("llama", seed=0).parameters(), lr=LR)
    foreign = _error(lambda: hp_core.track_optimizer(model, other))
    other.step()  # a step of an optimizer of no hp model attaches nothing ...
    foreign_hooks = len(other._optimizer_state_dict_post_hooks)
    other.add_param_group({"params": list(model.parameters())})
    other.step()  # ... until it holds parameters of one
    return {
        "wrong_shape": wrong_shape,
        "unchanged": unchanged,
        "untouched": untouched,
        "scrambled": scrambled_diff,
        "groups": groups,
        "unshaped": unshaped,
        "foreign": foreign,
        "foreign_hooks": foreign_hooks,
        "added_hooks": len(other._optimizer_state_dict_post_hooks),
    }


def track_round_trip() -> dict[str, Any]:
    """``track_optimizer`` then plain ``state_dict()`` / ``load_state_dict()`` before any
    step: DTensor moments, and full-tensor moments (a format ``torch.save`` keeps), load
    into fresh optimizers whose next steps equal the original's."""
    batches = _batches("llama")
    model = _applied("llama", 0, _tp_mesh(2), "production")
    opt = _optimizer(model)
    _train(model, opt, batches[:SAVE_AT])
    # Deep copies: like torch's, these state dicts hold the optimizer's own tensors.
    saved = copy.deepcopy(opt.state_dict())
    kinds = {type(v).__name__ for s in saved["state"].values() for v in s.values()}
    full = copy.deepcopy(saved)
    for entry in full["state"].values():
        for m, v in entry.items():
            entry[m] = v.full_tensor() if isinstance(v, DTensor) else v
    copies = []
    hooks = []
    for state in (saved, full):
        other = _applied("llama", 1, _tp_mesh(2), "production")
        other.load_state_dict(model.state_dict())
        other_opt = _optimizer(other)
        hp_core.track_optimizer(other, other_opt)
        hp_core.track_optimizer(other, other_opt)  # idempotent
        hooks.append(len(other_opt._optimizer_load_state_dict_pre_hooks))
        other_opt.load_state_dict(state)
        copies.append((other, other_opt))
    _train(model, opt, batches[SAVE_AT:])
    want = _full(model.state_dict())
    after = []
    for other, other_opt in copies:
        _train(other, other_opt, batches[SAVE_AT:])
        after.append(_rel(_full(other.state_dict()), want))

    validate = _applied("llama", 0, _tp_mesh(2), "validate")
    validate_opt = hp_core.track_optimizer(validate, _optimizer(validate))
    return {
        "kinds": kinds,
        "hooks": hooks,
        "after": after,
        "validate_hooks": len(validate_opt._optimizer_state_dict_post_hooks),
    }


def full_state_dict_round_trip() -> dict[str, Any]:
    """``StateDictOptions(full_state_dict=True)``: the optimizer state as full tensors (what
    one file of a whole model holds), loaded back into a fresh optimizer of a copy."""
    full = StateDictOptions(full_state_dict=True)
    batches = _batches("llama")
    model = _applied("llama", 0, _tp_mesh(2), "production")
    opt = _optimizer(model)
    _train(model, opt, batches[:SAVE_AT])
    osd = get_optimizer_state_dict(model, opt, options=full)
    other = _applied("llama", 1, _tp_mesh(2), "production")
    other.load_state_dict(model.state_dict())
    other_opt = _optimizer(other)
    set_optimizer_state_dict(other, other_opt, copy.deepcopy(osd), options=full)
    _train(model, opt, batches[SAVE_AT:])
    _train(other, other_opt, batches[SAVE_AT:])
    return {
        "kinds": {type(v).__name__ for s in osd["state"].values() for v in s.values()},
        "shape": tuple(osd["state"][MOMENT_KEYS[0]]["exp_avg"].shape),
        "after": _rel(_full(other.state_dict()), _full(model.state_dict())),
    }


def models_are_not_kept_alive() -> dict[str, Any]:
    """A production model and its stepped optimizer are collected once the user drops them;
    an optimizer that outlives its model keeps working, its hooks inert."""
    model = _applied("llama", 0, _tp_mesh(2), "production")
    opt = _optimizer(model)
    _train(model, opt, _batches("llama")[:1])
    model_ref = weakref.ref(model)
    del model
    gc.collect()
    kinds = {type(v).__name__ for s in opt.state_dict()["state"].values() for v in s.values()}
    opt.load_state_dict(opt.state_dict())
    opt_ref = weakref.ref(opt)
    del opt
    gc.collect()
    return {"model": model_ref() is None, "optimizer": opt_ref() is None, "kinds": kinds}
