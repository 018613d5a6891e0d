"""Rank-side tasks of the FSDP2-on-dp checkpoint tests (importable by the spawned ranks).

hp on tp inside, FSDP2 on dp outside (world 4: dp=2 x tp=2). The state dict holds one
DTensor per parameter over dp and tp together, so ``torch.distributed.checkpoint`` saves
every value once and reshards it to tp-only worlds and to one process.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

import hp_core
from hp_core.runtime.journal import Journal
from hp_core.runtime.param_layout import ParamLayout
from hp_core.runtime.state_dict import ShardedStateDict
from hp_core.runtime.state_views import local_value, saved_view
from hp_core.testing.families import build_family, family_batch

Q = "model.layers.0.self_attn.q_proj.weight"  # hp Shard(0) on tp: FSDP's split inside hp's
O_PROJ = "model.layers.0.self_attn.o_proj.weight"  # hp Shard(1) on tp: FSDP's Shard(0) beside it
NORM = "model.norm.weight"  # replicated by hp: an ordinary FSDP DTensor


def _kv4(**extra: Any) -> dict[str, Any]:
    return {"num_key_value_heads": 4, **extra}  # 4 kv heads: fits tp=2 and tp=4


def _full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in state.items()
    }


def _excess(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        return float("inf")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _logits(model: Any) -> torch.Tensor:
    batch = family_batch("llama", batch=2, seq=16)
    with torch.no_grad():
        return model(input_ids=batch, use_cache=False).logits.detach().clone()


def _spec(value: Any) -> tuple[tuple[str, ...], str]:
    return tuple(value.device_mesh.mesh_dim_names or ()), str(tuple(value.placements))


def _fsdp(
    model: Any, mode: str, sp: bool, hp_on: str = "root", dp_mesh: Any = None, mesh: Any = None
) -> Any:
    """hp on the ("dp", "tp") mesh (or only its "tp" slice), then FSDP2 on its "dp" slice."""
    if mesh is None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    hp_mesh = mesh if hp_on == "root" else mesh["tp"]
    hp_core.apply(model, hp_core.plan(model, hp_mesh, sequence_parallel=sp), hp_mesh, mode=mode)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"] if dp_mesh is None else dp_mesh)
    fully_shard(model, mesh=mesh["dp"] if dp_mesh is None else dp_mesh)
    return model


def _train_two_steps(par: Any, ref: Any, dp: int) -> list[torch.optim.Optimizer]:
    """Two AdamW steps; each dp replica on its own batch, the reference on both at once."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (ref, par)]
    for step in range(2):
        batches = [family_batch("llama", seed=100 * step + r) for r in range(2)]
        ref_loss = sum(ref(input_ids=b, labels=b, use_cache=False).loss for b in batches) / 2
        ref_loss.backward()
        par(input_ids=batches[dp], labels=batches[dp], use_cache=False).loss.backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    return opts


def _layouts(model: Any) -> dict[str, ParamLayout]:
    hooks = [getattr(h, "__self__", None) for h in model._state_dict_hooks.values()]
    return next(h for h in hooks if isinstance(h, ShardedStateDict)).layouts


def _moment_views(par: Any, ref: Any, opts: list[torch.optim.Optimizer]) -> dict[str, float]:
    """The two view functions on an AdamW moment shaped like its parameter (FSDP's dp
    DTensor): saved, it is the single-device moment; loaded back, FSDP's form again."""
    layout = _layouts(par)[Q]
    moment = opts[1].state[dict(par.named_parameters())[Q]]["exp_avg"]
    ref_moment = opts[0].state[dict(ref.named_parameters())[Q]]["exp_avg"]
    view = saved_view(moment, layout, Q)
    back = local_value(Q, view, layout, like=moment)
    from_full = local_value(Q, ref_moment, layout, like=moment)
    same_form = all(_spec(x) == _spec(moment) for x in (back, from_full))
    return {
        "moment_saved": float((view.full_tensor() - ref_moment).abs().max()),
        "moment_back": float((back.to_local() - moment.to_local()).abs().max()),
        "moment_from_full": float((from_full.to_local() - moment.to_local()).abs().max()),
        "moment_form": float(0.0 if same_form else 1.0),
    }


def fsdp_round_trip(path: str, mode: str, sp: bool) -> dict[str, Any]:
    """Train 2 steps at dp=2 x tp=2 under FSDP2, dcp.save, scramble, dcp.load back.

    Rank 0 also writes the gathered parameters and the trained single-device reference's
    logits next to the checkpoint, for the resharding tests to compare with.
    """
    base = build_family("llama", seed=0, **_kv4())
    ref = copy.deepcopy(base)
    par = _fsdp(copy.deepcopy(base), mode, sp)
    dp = dist.get_rank() // 2
    opts = _train_two_steps(par, ref, dp)
    moments = _moment_views(par, ref, opts) if mode == "production" else {}
    saved = get_model_state_dict(par)
    specs = {k: _spec(saved[k]) for k in (Q, O_PROJ, NORM)}
    full_saved = _full(saved)
    trained = _excess(full_saved, {k: v.detach() for k, v in ref.state_dict().items()})
    logits = _logits(par)
    dcp.save(saved, checkpoint_id=path)
    with torch.no_grad():  # scramble every parameter in place (FSDP's own shards)
        for p in par.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.add_(torch.randn_like(local))
    scrambled = _excess(_full(get_model_state_dict(par)), full_saved)
    target = get_model_state_dict(par)
    dcp.load(target, checkpoint_id=path)
    set_model_state_dict(par, target)
    restored = _excess(_full(get_model_state_dict(par)), full_saved)
    logits_after = _logits(par)
    if dist.get_rank() == 0:
        torch.save({"params": full_saved, "logits": _logits(ref)}, f"{path}.reference.pt")
    dist.barrier()
    return {
        **moments,
        "specs": specs,
        "trained": trained,
        "logits_vs_ref": float((logits - _logits(ref)).abs().max()),
        "scrambled": scrambled,
        "restored": restored,
        "logits": float((logits_after - logits).abs().max()),
    }


def _compare(model: Any, reference: dict[str, Any]) -> dict[str, Any]:
    got = _full(get_model_state_dict(model))
    return {
        "params": _excess(got, reference["params"]),
        "logits": float((_logits(model) - reference["logits"]).abs().max()),
    }


def load_at_tp(path: str, tp: int) -> dict[str, Any]:
    """Load the dp x tp FSDP2 checkpoint at tp (this world's size, no FSDP)."""
    reference = torch.load(f"{path}.reference.pt")
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    model = build_family("llama", seed=1, **_kv4())
    hp_core.apply(model, hp_core.plan(model, mesh), mesh)
    before = _compare(model, reference)["params"]
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    return {"before": before, **_compare(model, reference)}


def save_at_tp4(path: str) -> bool:
    """Save the seed-0 model at tp=4 (world 4, no FSDP)."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    model = build_family("llama", seed=0, **_kv4())
    hp_core.apply(model, hp_core.plan(model, mesh), mesh)
    dcp.save(model.state_dict(), checkpoint_id=path)
    return True


def load_into_fsdp(path: str, mode: str) -> dict[str, Any]:
    """Load a tp=4 checkpoint of the seed-0 model into dp=2 x tp=2 under FSDP2."""
    one = build_family("llama", seed=0, **_kv4())
    reference = {"params": {k: v.detach() for k, v in one.state_dict().items()}}
    reference["logits"] = _logits(one)
    model = _fsdp(build_family("llama", seed=1, **_kv4()), mode, sp=True)
    before = _compare(model, reference)["params"]
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)
    return {"before": before, **_compare(model, reference)}


def load_a_wider_checkpoint(path: str) -> dict[str, Any]:
    """A checkpoint of a model with a wider MLP cannot load into this one; nothing changes."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    wide = build_family("llama", seed=0, **_kv4(intermediate_size=256))
    hp_core.apply(wide, hp_core.plan(wide, mesh), mesh)
    dcp.save(wide.state_dict(), checkpoint_id=path)
    model = _fsdp(build_family("llama", seed=1, **_kv4()), "production", sp=False)
    before = _full(get_model_state_dict(model))
    state = get_model_state_dict(model)
    try:
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state)
        error = None
    except CheckpointException as e:  # DCP gathers every rank's error (a BaseException)
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "unchanged": _excess(_full(get_model_state_dict(model)), before)}


def _hand_laid_linear(mesh: Any, full: torch.Tensor) -> Any:
    """A linear holding tp rank t's rows of ``full`` (hp's Shard(0) on tp, by hand), with
    hp's state-dict hooks for that layout, then FSDP2 on dp."""
    tp = mesh.get_local_rank("tp")
    layout = ParamLayout(mesh, (Replicate(), Shard(0)), full.shape, full.stride())
    rows = torch.chunk(full, 2)[tp]
    lin = torch.nn.Linear(full.shape[1], rows.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(rows)
    ShardedStateDict({"weight": layout}).attach(lin, Journal())
    fully_shard(lin, mesh=mesh["dp"])
    return lin


def uneven_dp3(path: str) -> dict[str, Any]:
    """dp=3 x tp=2 and 7 rows: tp ranks hold 4 and 3 rows, FSDP splits them 2+2+0 and 1+1+1.
    ``_StridedShard`` would misplace these slices, so the view gathers over dp instead."""
    mesh = init_device_mesh("cpu", (3, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(21.0).reshape(7, 3)
    lin = _hand_laid_linear(mesh, full)
    raw = lin.weight  # FSDP's dp DTensor of this tp rank's rows
    strided = (_StridedShard(0, split_factor=2), Shard(0))
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, strided)
    tp_start = 4 * mesh.get_local_rank("tp")
    _, inner = compute_local_shape_and_global_offset(raw.shape, raw.device_mesh, raw.placements)
    misplaced = tuple(shape) != tuple(raw.to_local().shape) or (
        raw.to_local().numel() > 0 and offset[0] != tp_start + inner[0]
    )
    saved = lin.state_dict()["weight"]
    dcp.save(lin.state_dict(), checkpoint_id=path)
    # the negative control: FSDP's slices under _StridedShard, saved as they are
    as_strided = DTensor.from_local(
        raw.to_local(), mesh, strided, run_check=False, shape=full.shape, stride=full.stride()
    )
    dcp.save({"weight": as_strided}, checkpoint_id=f"{path}.strided")
    with torch.no_grad():
        lin.weight.to_local().add_(100.0)
    state = lin.state_dict()
    dcp.load(state, checkpoint_id=path)
    lin.load_state_dict(state)
    got = lin.state_dict()["weight"].full_tensor()
    hp_core.save_checkpoint(f"{path}.checked", lin)  # staging copies, then into FSDP's shard
    with torch.no_grad():
        lin.weight.to_local().add_(100.0)
    hp_core.load_checkpoint(f"{path}.checked", lin)
    checked = float((lin.state_dict()["weight"].full_tensor() - full).abs().max())
    return {
        "checked": checked,
        "misplaced": misplaced,
        "saved": (_spec(saved), saved.to_local().shape[0]),
        "restored": float((got - full).abs().max()),
    }


def other_forms(path: str, hp_on: str) -> dict[str, Any]:
    """Full tensors, a DTensor on another mesh, a DCP round trip, and one rank's FSDP
    shard (refused), for hp on the root mesh or on its 1-D "tp" slice."""
    one = build_family("llama", seed=0, **_kv4())
    full = {k: v.detach().clone() for k, v in one.state_dict().items()}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    hp_mesh = mesh if hp_on == "root" else mesh["tp"]
    model = _fsdp(build_family("llama", seed=1, **_kv4()), "production", False, hp_on, mesh=mesh)
    specs = {k: _spec(v) for k, v in get_model_state_dict(model).items() if k == Q}
    # FSDP2's own way in for full tensors (it distributes them over the views' layouts)
    full_copy = {k: v.clone() for k, v in full.items()}  # torch replaces its values
    set_model_state_dict(model, full_copy, options=StateDictOptions(full_state_dict=True))
    from_full = _excess(_full(get_model_state_dict(model)), full)
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    # hp's sharded keys also take plain full tensors and DTensors of another mesh through
    # load_state_dict (FSDP's own replicated params take neither: torch's rule)
    hp_keys = [k for k, v in get_model_state_dict(model).items() if _spec(v)[0] == ("dp", "tp")]
    model.load_state_dict({k: -full[k] for k in hp_keys}, strict=False)
    from_plain = _excess(
        _full(get_model_state_dict(model)), {**full, **{k: -full[k] for k in hp_keys}}
    )
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    on_flat = {k: distribute_tensor(full[k], flat, [Shard(0)]) for k in hp_keys}
    model.load_state_dict(on_flat, strict=False)
    from_flat = _excess(_full(get_model_state_dict(model)), full)
    model.load_state_dict({k: -full[k] for k in hp_keys}, strict=False)
    replicated = [Replicate()] * hp_mesh.ndim  # a DTensor on hp's own mesh
    on_hp = {k: distribute_tensor(full[k], hp_mesh, replicated) for k in hp_keys}
    model.load_state_dict(on_hp, strict=False)
    from_hp_mesh = _excess(_full(get_model_state_dict(model)), full)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().mul_(-1.0)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)
    round_trip = _excess(_full(get_model_state_dict(model)), full)
    hp_core.save_checkpoint(f"{path}.checked", model)  # hp's checked pair composes too
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().mul_(-1.0)
    hp_core.load_checkpoint(f"{path}.checked", model)
    checked = _excess(_full(get_model_state_dict(model)), full)
    fsdp_own = dict(model.named_parameters())[Q]  # FSDP's dp DTensor of one tp shard
    before = _full(get_model_state_dict(model))
    try:
        model.load_state_dict({**full, Q: fsdp_own.detach().clone()})
        error = None
    except hp_core.HpError as e:
        error = f"{type(e).__name__}: {e}"
    return {
        "specs": specs,
        "hp_keys": len(hp_keys),
        "from_full": from_full,
        "from_plain": from_plain,
        "from_flat": from_flat,
        "from_hp_mesh": from_hp_mesh,
        "round_trip": round_trip,
        "checked": checked,
        "error": error,
        "unchanged": _excess(_full(get_model_state_dict(model)), before),
    }


def raw_fsdp_dtensors(path: str) -> dict[str, Any]:
    """Negative control: saving FSDP's own dp DTensors (what the state dict held before
    hp combined them) loses the tp ranks' differences."""
    model = _fsdp(build_family("llama", seed=0, **_kv4()), "production", False)
    before = _full(get_model_state_dict(model))
    raw = {n: p for n, p in model.named_parameters()}
    dcp.save(raw, checkpoint_id=path)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
    dcp.load(raw, checkpoint_id=path)
    return {"restored": _excess(_full(get_model_state_dict(model)), before)}


def meshes_that_do_not_combine() -> dict[str, Any]:
    """FSDP2 over hp's tp ranks again: with hp on the "tp" slice no mesh holds both; with hp
    on the root, FSDP's "dp" of a ("tp", "dp")-ordered mesh names other ranks. Saving says so."""
    errors = []
    cases = [
        ("tp", init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))["b"]),
        ("root", init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))["dp"]),
    ]
    for hp_on, dp_mesh in cases:
        model = _fsdp(build_family("llama", seed=0, **_kv4()), "production", False, hp_on, dp_mesh)
        try:
            model.state_dict()
            errors.append(None)
        except hp_core.HpError as e:
            errors.append(f"{type(e).__name__}: {e}")
    return {"errors": errors}
