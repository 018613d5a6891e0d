"""Rank-side tasks of the comparison helpers' negative controls (importable by the spawned ranks).

Each task builds a correct tp=2 run of the tiny llama (or a fabricated model), breaks it in
one known way, and returns what the helpers of ``hp_core.testing.compare`` made of it: the
test file asserts every broken run is caught and every correct one passes.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import hp_core
from hp_core.presets import build_model
from hp_core.testing.compare import (
    GradientCheckError,
    allclose_excess,
    assert_weights_changed,
    full_grads,
    gather_full_grads,
    grads_excess,
    max_abs_diff,
    nan_safe_max,
    run_excess,
    snapshot_params,
    unmoved_params,
    weights_changed,
)

VOCAB = 128
RTOL = 1e-5
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"  # tp: Shard(0)
O_PROJ = "model.layers.1.self_attn.o_proj.weight"  # tp: Shard(1)
NORM = "model.norm.weight"  # replicated


def _batch(step: int, batch: int = 2, seq: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def _mesh() -> Any:
    return init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def _ref_grads(ref: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def _one_step(mode: str) -> tuple[nn.Module, nn.Module, Any, tuple, tuple]:
    """A reference and a ``mode`` tp=2 copy of the tiny llama, after one forward/backward."""
    base = build_model("llama", seed=0)
    mesh = _mesh()
    ref, par = copy.deepcopy(base), copy.deepcopy(base)
    hp_core.apply(par, hp_core.plan(par, mesh), mesh, mode=mode)
    ids = _batch(0)
    outs = []
    for m in (ref, par):
        out = m(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        outs.append((out.loss.detach(), out.logits.detach()))
    return ref, par, mesh, outs[0], outs[1]


def _error(fn: Any, *args: Any, **kwargs: Any) -> str | None:
    """The message of the ``GradientCheckError`` ``fn`` raised, or None when it passed."""
    try:
        fn(*args, **kwargs)
    except GradientCheckError as e:
        return str(e)
    return None


def positive_control(steps: int = 2) -> dict[str, Any]:
    """A correct run, production and validate: every excess, full_grads agreement, steps."""
    base = build_model("llama", seed=0)
    mesh = _mesh()
    ref, prod, val = (copy.deepcopy(base) for _ in range(3))
    for m, mode in ((prod, "production"), (val, "validate")):
        hp_core.apply(m, hp_core.plan(m, mesh), mesh, mode=mode)
    models = {"ref": ref, "prod": prod, "val": val}
    opts = {
        k: torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6, foreach=False)
        for k, m in models.items()
    }
    res: dict[str, Any] = {
        f"{k}:{w}": 0.0 for k in ("prod", "val") for w in ("loss", "logits", "grad")
    }
    res.update({f"{k}:agree": 0.0 for k in ("prod", "val")})
    res.update({f"{k}:unmoved": [] for k in models})  # moved by no step, or to NaN/inf
    res.update({f"{k}:checked": math.inf for k in models})  # the fewest parameters a step checked
    spread: dict[str, float] = {}
    for step in range(steps):
        ids = _batch(step)
        got: dict[str, Any] = {}
        for k, m in models.items():
            opts[k].zero_grad(set_to_none=True)
            out = m(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            if k == "ref":
                grads = _ref_grads(m)
            else:
                grads = gather_full_grads(m, ref, mesh, stats=spread)
                agree = nan_safe_max(max_abs_diff(grads, full_grads(m, mesh)).values())
                res[f"{k}:agree"] = max(res[f"{k}:agree"], agree)
            got[k] = (out.loss.detach(), out.logits.detach(), grads)
        for k in ("prod", "val"):
            for what, value in run_excess(got[k], got["ref"], rtol=RTOL).items():
                res[f"{k}:{what}"] = nan_safe_max([res[f"{k}:{what}"], value])
        before = {k: snapshot_params(m, only_with_grad=True) for k, m in models.items()}
        for opt in opts.values():
            opt.step()
        for k, m in models.items():
            res[f"{k}:unmoved"] = sorted({*res[f"{k}:unmoved"], *unmoved_params(before[k], m)})
            res[f"{k}:checked"] = min(res[f"{k}:checked"], len(before[k]))
    res["n_grads"] = len(got["ref"][2])
    res["n_gathered"] = {k: len(got[k][2]) for k in ("prod", "val")}
    res["replica_checked"] = sorted(spread)
    res["replica_spread"] = max(spread.values(), default=0.0)
    return res


def nan_control() -> dict[str, Any]:
    """NaN/inf in one gradient, the logits, the loss, or everywhere: every excess is inf."""
    ref, prod, mesh, (loss_r, logits_r), (loss_p, logits_p) = _one_step("production")
    rank = dist.get_rank()
    expected = (loss_r, logits_r, _ref_grads(ref))
    res: dict[str, Any] = {}
    res["clean"] = run_excess((loss_p, logits_p, gather_full_grads(prod, ref, mesh)), expected)
    nan_logits, nan_loss = logits_p.clone(), torch.full_like(loss_p, math.nan)
    nan_logits[0, 3, 5] = math.nan
    q_grad, o_grad = (prod.get_parameter(n).grad for n in (Q_PROJ, O_PROJ))
    q_clean, o_clean = q_grad.clone(), o_grad.clone()
    with torch.no_grad():
        if rank == 0:  # one element of one rank's shard of a sharded gradient
            prod.get_parameter(Q_PROJ).grad[1, 2] = math.nan
        res["nan_grad"] = run_excess(
            (loss_p, logits_p, gather_full_grads(prod, ref, mesh)), expected
        )
        q_grad.copy_(q_clean)
        if rank == 1:
            prod.get_parameter(O_PROJ).grad[0, 0] = math.inf
        res["inf_grad"] = run_excess(
            (loss_p, logits_p, gather_full_grads(prod, ref, mesh)), expected
        )
        o_grad.copy_(o_clean)
        grads = gather_full_grads(prod, ref, mesh)
        res["nan_logits"] = run_excess((loss_p, nan_logits, grads), expected)
        res["nan_loss"] = run_excess((nan_loss, logits_p, grads), expected)
        for p in prod.parameters():  # a model whose every output and gradient is NaN
            p.grad.fill_(math.nan)
        all_nan = gather_full_grads(prod, ref, mesh)  # equal NaNs are equal replicas
        res["all_nan"] = run_excess(
            (nan_loss, torch.full_like(logits_p, math.nan), all_nan), expected
        )
    return res


def noop_optimizer_control() -> dict[str, Any]:
    """AdamW with lr=0 changes nothing (though losses on two batches differ); lr=1e-3 does."""
    _, prod, _, _, _ = _one_step("production")
    res: dict[str, Any] = {}
    for lr in (0.0, 1e-3):
        opt = torch.optim.AdamW(prod.parameters(), lr=lr, eps=1e-6, foreach=False)
        losses = []
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            ids = _batch(step)
            out = prod(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            losses.append(float(out.loss.detach()))
            before = snapshot_params(prod, only_with_grad=True)
            opt.step()
        # what each helper makes of the last step (each is under test, so each is called)
        changes = weights_changed(before, prod)
        try:
            assert_weights_changed(before, prod)
            flagged = None
        except AssertionError as e:
            flagged = str(e)
        res[lr] = {
            "losses_differ": losses[0] != losses[1],  # the old "the optimizer stepped" check
            "max_change": nan_safe_max(changes.values()),
            "unmoved": unmoved_params(before, prod),
            "params": sorted(before),
            "n_params": len(changes),
            "flagged": flagged,
        }
    return res


def permuted_layout_control() -> dict[str, Any]:
    """Swap the tp ranks' shards of ``q_proj.weight`` (weight and gradient alike)."""
    ref, prod, mesh, _, _ = _one_step("production")
    rank = dist.get_rank()
    ref_grad = ref.get_parameter(Q_PROJ).grad
    p = prod.get_parameter(Q_PROJ)
    res: dict[str, Any] = {}
    before = gather_full_grads(prod, ref, mesh)[Q_PROJ]
    res["before"] = allclose_excess(before, ref_grad)
    group = mesh.get_group("tp")
    with torch.no_grad():
        for t in (p.data, p.grad):  # all-gather, then re-slice in the wrong order
            parts = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t.copy_(parts[1 - rank])
    grads = gather_full_grads(prod, ref, mesh)
    res["after"] = allclose_excess(grads[Q_PROJ], ref_grad)
    swapped = torch.cat(before.chunk(2, dim=0)[::-1], dim=0)
    res["is_the_swap"] = allclose_excess(grads[Q_PROJ], swapped, rtol=0.0)
    others = {n: g for n, g in grads.items() if n != Q_PROJ}
    res["others"] = nan_safe_max(
        max_abs_diff(others, {n: _ref_grads(ref)[n] for n in others}).values()
    )
    res["run_grad"] = grads_excess(grads, _ref_grads(ref), rtol=RTOL)
    res["table_gather"] = allclose_excess(full_grads(prod, mesh)[Q_PROJ], ref_grad)
    return res


def replica_control() -> dict[str, Any]:
    """A replicated gradient that differs across ranks (a skipped reduction on one rank)."""
    ref, prod, mesh, _, _ = _one_step("production")
    rank = dist.get_rank()
    ref_grads = _ref_grads(ref)
    g = prod.get_parameter(NORM).grad
    res: dict[str, Any] = {"clean": _error(gather_full_grads, prod, ref, mesh)}
    noise = torch.randn(g.shape, generator=torch.Generator().manual_seed(7 + rank))
    with torch.no_grad():
        if rank == 1:
            g.add_(1e-8 * noise)  # rounding-sized: within the replica tolerance
        res["rounding"] = _error(gather_full_grads, prod, ref, mesh)
        if rank == 1:
            g.add_(1e-3 * noise)  # a missing reduction's size
        res["unreduced"] = _error(gather_full_grads, prod, ref, mesh)
        res["strict"] = _error(gather_full_grads, prod, ref, mesh, replica_tol=0.0)
        # Without the cross-rank check, rank 0's own comparison sees nothing wrong.
        local = gather_full_grads(prod, ref, mesh, replica_axes=())
        res["local_excess"] = allclose_excess(local[NORM], ref_grads[NORM])
        res["max_injected"] = float((1e-8 + 1e-3) * noise.abs().max()) if rank == 1 else 0.0
    return res


def unreduced_validate_control() -> dict[str, Any]:
    """Validate mode: a Partial (unreduced) gradient, a Replicate one that is not, a wrong one."""
    ref, val, mesh, _, _ = _one_step("validate")
    rank = dist.get_rank()
    ref_grad = ref.get_parameter(NORM).grad
    p = val.get_parameter(NORM)
    good = p.grad
    res: dict[str, Any] = {"clean": _error(gather_full_grads, val, ref, mesh)}
    res["placements"] = [repr(x) for x in good.placements]
    # Each rank holds half: the sum is right, so full_tensor() hides the missing reduction.
    p.grad = DTensor.from_local(good.to_local() / 2, mesh, [Partial()], run_check=False)
    res["hidden"] = allclose_excess(full_grads(val, mesh)[NORM], ref_grad)
    res["partial"] = _error(gather_full_grads, val, ref, mesh)
    local = good.to_local() + 1e-3 * rank
    p.grad = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
    res["replicas"] = _error(gather_full_grads, val, ref, mesh)
    p.grad = DTensor.from_local(good.to_local().chunk(2)[rank], mesh, [Shard(0)], run_check=False)
    res["other_placement"] = _error(gather_full_grads, val, ref, mesh)
    p.grad = good
    res["restored"] = _error(gather_full_grads, val, ref, mesh)
    return res


class _Params(nn.Module):
    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))


class _Experts(nn.Module):
    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        self.experts = _Params(shapes)


def layout_errors() -> dict[str, Any]:
    """Fabricated local gradients whose layout matches nothing: each is named, with shapes."""
    mesh = _mesh()
    rank = dist.get_rank()
    full = {n: (8, 6) for n in "abcdfgh"} | {"e": (4,)}
    local = {
        "a": (4, 6),  # Shard(0) over tp: fine
        "b": (4, 3),  # two dims differ
        "c": (8, 2),  # split 3 ways: no axis of size 3
        "d": (8, 6) if rank == 0 else (4, 6),  # ranks disagree
        "e": (4,),  # replicated: fine
        "f": (8, 6, 1),  # another rank
        "g": (5, 6),  # no even split
        "z": (3,),  # the reference has no z
    }
    model = _Params(local)
    for q in model.parameters():
        q.grad = torch.ones_like(q)
    res: dict[str, Any] = {"error": _error(gather_full_grads, model, full, mesh)}
    # The gradient set must be the same on every rank.
    one = _Params({"e": (4,)})
    one.e.grad = torch.ones(4) if rank == 0 else None
    res["sets"] = _error(gather_full_grads, one, {"e": torch.ones(4)}, mesh)
    for key, call in (
        ("unnamed", lambda: gather_full_grads(one, {}, init_device_mesh("cpu", (2,)))),
        ("unknown_axis", lambda: gather_full_grads(one, {}, mesh, replica_axes=("cp",))),
    ):
        try:
            call()
        except ValueError as e:
            res[key] = str(e)
    return res


def expert_gather() -> dict[str, Any]:
    """Expert parameters gathered over an expert group the caller gives (group or mesh)."""
    mesh = _mesh()
    rank = dist.get_rank()
    full = {"experts.w": torch.arange(24.0).reshape(4, 3, 2), "experts.v": torch.ones(2, 3)}
    model = _Experts({"w": (2, 3, 2), "v": (2, 3)})
    model.experts.w.grad = full["experts.w"].chunk(2)[rank].clone()
    model.experts.v.grad = torch.ones(2, 3)
    ep_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("edp", "ep"))
    res: dict[str, Any] = {}
    for label, groups in (
        ("mesh", {2: ep_mesh}),
        ("group", {"ep": mesh.get_group("tp")}),
        ("list", [mesh]),
        ("none", None),  # falls back to the tp axis, which is the same group here
    ):
        grads = gather_full_grads(model, full, mesh, expert_groups=groups)
        res[label] = nan_safe_max(max_abs_diff(grads, full).values())
    try:
        bad = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))
        gather_full_grads(model, full, mesh, expert_groups=bad)
    except ValueError as e:
        res["bad_mesh"] = str(e)
    quarter = _Experts({"w": (1, 3, 2)})  # E / 4: no expert group of size 4
    quarter.experts.w.grad = torch.ones(1, 3, 2)
    res["no_group"] = _error(gather_full_grads, quarter, full, mesh, expert_groups=ep_mesh)
    return res


def expert_positive_control() -> dict[str, Any]:
    """qwen2moe, tp=2 with ep=2 (hp-plugin-moe): both modes pass; the gatherers agree."""
    base = build_model("qwen2moe", seed=0)
    mesh = _mesh()
    ref = copy.deepcopy(base)
    ids = _batch(0)
    out = ref(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    expected = (out.loss.detach(), out.logits.detach(), _ref_grads(ref))
    moe = [
        {
            "match": "model.layers.*.mlp",
            "when": "ep",
            "local_compute_fn": "qwen2moe",
            "region_dispatch": False,
        }
    ]
    res: dict[str, Any] = {}
    for mode in ("production", "validate"):
        m = copy.deepcopy(base)
        hp_core.apply(m, hp_core.plan(m, mesh, ep_size=2, overrides=moe), mesh, mode=mode)
        out = m(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        groups = m._hp_applied.expert_meshes  # the caller hands the expert meshes over
        grads = gather_full_grads(m, ref, mesh, expert_groups=groups)
        res[mode] = run_excess((out.loss.detach(), out.logits.detach(), grads), expected)
        res[f"{mode}:agree"] = nan_safe_max(max_abs_diff(grads, full_grads(m, mesh)).values())
        experts = [n for n, p in m.named_parameters() if ".experts." in n]
        res[f"{mode}:experts"] = {n: list(_local_shape(m.get_parameter(n))) for n in experts}
    return res


def _local_shape(p: torch.Tensor) -> torch.Size:
    return p.to_local().shape if isinstance(p, DTensor) else p.shape
