"""Rank-side tasks for the tensor/sequence-parallel tests (importable by the spawned ranks).

Every equivalence task compares a parallel copy with a single-device run of the same
weights. The weights are perturbed by seeded noise (``build_family``), so zero biases and
unit norm weights cannot make a comparison trivially equal; the parallel gradients are
gathered by ``gather_full_grads`` (which infers each layout from the shapes, checks the
replicated gradients agree across ranks, and never reads hp's placement tables); every
fold is NaN-safe; and "the optimizer stepped" is checked on the weights themselves.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from hp_core import plan as make_plan
from hp_core.apply import apply
from hp_core.plans.prediction import input_check_axes, step_collectives
from hp_core.presets import build_model
from hp_core.testing.compare import (
    allclose_excess,
    full_tensor,
    gather_full_grads,
    grads_excess,
    max_abs_diff,
    nan_safe_max,
    run_excess,
    snapshot_params,
    unmoved_params,
)
from hp_core.testing.families import family_model, perturb_
from hp_core.testing.probe import by_phase, count_step

VOCAB = 128
RTOL = 1e-5
#: The faults ``train_compare`` can inject (negative controls of its own checks).
FAULTS = (None, "nan_grad", "lr0", "swap_heads")
#: The attention of layer 0: its tp shards are swapped across ranks by the ``swap_heads`` fault.
ATTN0 = "model.layers.0.self_attn"


def _batch(step: int, batch: int = 2, seq: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _logits(out: Any, loss_parallel: bool, mesh: Any) -> torch.Tensor:
    # The test's own expectation (vocab-sharded logits under loss parallel), not hp's table.
    return full_tensor(out.logits, {"tp": Shard(2)}, mesh) if loss_parallel else out.logits


def _ref_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _swap_tp_shards(model: nn.Module, fqn: str, mesh: Any) -> list[str]:
    """Swap every tp shard of ``fqn``'s parameters between the two tp ranks (production mode).

    Done to q/k/v (rows) and o (columns) of one attention, it permutes its heads
    consistently: the model computes exactly the same function, so loss and logits still
    match, but each rank's weights and gradients sit in the other rank's place.
    """
    group = mesh.get_group("tp")
    rank = dist.get_rank(group)
    swapped = []
    with torch.no_grad():
        for name, p in model.get_submodule(fqn).named_parameters():
            parts = [torch.empty_like(p) for _ in range(2)]
            dist.all_gather(parts, p.detach().contiguous(), group=group)
            if not torch.equal(parts[0], parts[1]):  # a sharded parameter (not a replica)
                p.copy_(parts[1 - rank])
                swapped.append(f"{fqn}.{name}")
    return swapped


def train_compare(
    family: str,
    mesh_shape,
    mesh_names,
    *,
    sp: bool = True,
    loss_parallel: bool = False,
    steps: int = 3,
    fault: str | None = None,
    **config,
) -> dict:
    """Reference vs production vs validate: loss, logits and every gradient, for ``steps`` AdamW
    steps.

    ``excess`` holds ``allclose`` excesses (see ``hp_core.testing.compare.allclose_excess``,
    inf for NaN/inf): a case passes when each is <= atol. ``not_stepped`` lists, per model,
    the parameters with a gradient that some optimizer step did not move (or made
    non-finite) on this rank. ``fault`` breaks the run in one known way (see ``FAULTS``).
    """
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}")
    base = family_model(family, **config)
    mesh = _mesh(tuple(mesh_shape), tuple(mesh_names))
    ref, prod, val = (copy.deepcopy(base) for _ in range(3))
    for m, mode in ((prod, "production"), (val, "validate")):
        apply(
            m,
            make_plan(m, mesh, sequence_parallel=sp, loss_parallel=loss_parallel),
            mesh,
            mode=mode,
        )
    swapped = _swap_tp_shards(prod, ATTN0, mesh) if fault == "swap_heads" else []
    models = {"ref": ref, "prod": prod, "val": val}
    # lr 1e-3 and eps 1e-6: Adam divides each update by its own gradient's size, so with the
    # default eps an element whose gradient is rounding noise (~1e-9) gets a noise-driven
    # update; eps 1e-6 bounds that effect far below the comparison tolerance.
    lr = 0.0 if fault == "lr0" else 1e-3
    opts = {
        k: torch.optim.AdamW(m.parameters(), lr=lr, eps=1e-6, foreach=False)
        for k, m in models.items()
    }
    excess = {
        f"{a}-{b}:{what}": 0.0
        for a, b in (("prod", "ref"), ("val", "ref"), ("prod", "val"))
        for what in ("loss", "logits", "grad")
    }
    not_stepped: dict[str, set[str]] = {k: set() for k in models}
    losses = []
    for step in range(steps):
        ids = _batch(step)
        res = {}
        for k, m in models.items():
            opts[k].zero_grad(set_to_none=True)
            out = m(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            if fault == "nan_grad" and k == "prod" and step == 0 and dist.get_rank() == 0:
                with torch.no_grad():  # one element of one rank's shard of a sharded gradient
                    m.get_parameter(f"{ATTN0}.q_proj.weight").grad[1, 2] = math.nan
            # Every dp slice trains the same batch here, so replicas must agree over dp too.
            grads = (
                _ref_grads(m)
                if k == "ref"
                else gather_full_grads(m, ref, mesh, replica_axes=tuple(mesh_names))
            )
            res[k] = (
                out.loss.detach(),
                _logits(out, loss_parallel and k != "ref", mesh).detach(),
                grads,
            )
        losses.append(float(res["ref"][0]))
        for a, b in (("prod", "ref"), ("val", "ref"), ("prod", "val")):
            for what, value in run_excess(res[a], res[b], rtol=RTOL).items():
                excess[f"{a}-{b}:{what}"] = nan_safe_max([excess[f"{a}-{b}:{what}"], value])
        before = {k: snapshot_params(m, only_with_grad=True) for k, m in models.items()}
        for opt in opts.values():
            opt.step()
        for k, m in models.items():
            not_stepped[k].update(unmoved_params(before[k], m))
            if not before[k]:
                not_stepped[k].add("<no parameter had a gradient>")
    return {
        "excess": excess,
        "not_stepped": {k: sorted(v) for k, v in not_stepped.items()},
        "losses": losses,
        "n_grads": len(res["ref"][2]),
        "n_params": len(list(ref.named_parameters())),
        "swapped": swapped,
    }


def count_collectives(
    family: str,
    mode: str,
    *,
    sp: bool = True,
    loss_parallel: bool = False,
    layers: int = 2,
    **config,
) -> dict:
    """Measured collectives of one forward and one backward, and the plan's prediction."""
    model = build_model(family, seed=0, num_hidden_layers=layers, **config)
    mesh = _mesh((2,), ("tp",))
    p = make_plan(model, mesh, sequence_parallel=sp, loss_parallel=loss_parallel)
    apply(model, p, mesh, mode=mode)
    ids = _batch(0)
    measured = count_step(lambda: model(input_ids=ids, labels=ids, use_cache=False).loss)
    checks = input_check_axes(mesh.mesh_dim_names, mesh.shape)
    reductions = model._hp_applied.report.reductions
    pred = by_phase(
        step_collectives(
            p.modules, loss_parallel=loss_parallel, reductions=reductions, check_axes=checks
        )
    )
    return {
        "forward": measured["forward"],
        "backward": measured["backward"],
        "pred_forward": pred["forward"],
        "pred_backward": pred["backward"],
        "sync_reductions": model._hp_applied.grad_reducer.reductions
        if model._hp_applied.grad_reducer
        else 0,
    }


def dtensor_dispatches(family: str, mode: str) -> int:
    """How many aten ops saw a DTensor argument during one training step."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Probe(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat, _ = tree_flatten((args, kwargs or {}))
            if any(isinstance(a, DTensor) for a in flat):
                Probe.calls += 1
            return func(*args, **(kwargs or {}))

    model = build_model(family, seed=0)
    mesh = _mesh((2,), ("tp",))
    apply(model, make_plan(model, mesh), mesh, mode=mode)
    ids = _batch(0)
    with Probe():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return Probe.calls


def grad_accumulation(family: str) -> float:
    """Two micro-batches accumulated, SP on: gradients equal the single-device sum."""
    base = family_model(family)
    mesh = _mesh((2,), ("tp",))
    ref, prod = copy.deepcopy(base), copy.deepcopy(base)
    apply(prod, make_plan(prod, mesh), mesh, mode="production")
    for step in range(2):
        ids = _batch(step)
        ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        prod(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    diffs = max_abs_diff(gather_full_grads(prod, ref, mesh), _ref_grads(ref))
    return nan_safe_max(diffs.values())


def meta_apply(mode: str) -> dict:
    """Apply to a meta-device model: parameters stay meta, with their local shapes."""
    model = build_model("llama", seed=0, device="meta")
    mesh = _mesh((2,), ("tp",))
    apply(model, make_plan(model, mesh), mesh, mode=mode)
    q = model.model.layers[0].self_attn.q_proj.weight
    local = q.to_local() if hasattr(q, "to_local") else q
    return {"meta": bool(local.is_meta), "local_shape": tuple(local.shape)}


def head_attrs_compare() -> dict:
    """A model that keeps head counts on its attention modules: divided in production only."""
    import torch.nn.functional as F

    from tests._toy_models import head_attention_lm

    torch.manual_seed(0)
    base = perturb_(head_attention_lm(), seed=0)  # RMSNorm weights start at one: perturb them
    mesh = _mesh((2,), ("tp",))
    ref, prod, val = (copy.deepcopy(base) for _ in range(3))
    for m, mode in ((prod, "production"), (val, "validate")):
        apply(m, make_plan(m, mesh), mesh, mode=mode)
    ids = _batch(0)
    res = {}
    for k, m in (("ref", ref), ("prod", prod), ("val", val)):
        logits = m(ids)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1))
        loss.backward()
        res[k] = (logits.detach(), _ref_grads(m) if k == "ref" else gather_full_grads(m, ref, mesh))
    attn = lambda m: m.model.layers[0].self_attn  # noqa: E731
    return {
        "prod_heads": (attn(prod).num_heads, attn(prod).num_key_value_heads),
        "val_heads": (attn(val).num_heads, attn(val).num_key_value_heads),
        "logits": nan_safe_max(allclose_excess(res[k][0], res["ref"][0]) for k in ("prod", "val")),
        "grad": nan_safe_max(
            grads_excess(res[k][1], res["ref"][1], rtol=RTOL) for k in ("prod", "val")
        ),
        "n_grads": len(res["ref"][1]),
    }


def tied_stays_tied(mode: str) -> bool:
    model = build_model("llama", seed=0, tie_word_embeddings=True)
    mesh = _mesh((2,), ("tp",))
    apply(model, make_plan(model, mesh), mesh, mode=mode)
    return model.lm_head.weight is model.model.embed_tokens.weight


def finalize_twice_is_harmless() -> float:
    """finalize_grads after the automatic reduction must not sum the gradients again."""
    import hp_core

    base = family_model("llama")
    mesh = _mesh((2,), ("tp",))
    ref, prod = copy.deepcopy(base), copy.deepcopy(base)
    apply(prod, make_plan(prod, mesh), mesh, mode="production")
    ids = _batch(0)
    ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    prod(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    hp_core.finalize_grads(prod)
    hp_core.finalize_grads(prod)
    diffs = max_abs_diff(gather_full_grads(prod, ref, mesh), _ref_grads(ref))
    return nan_safe_max(diffs.values())
