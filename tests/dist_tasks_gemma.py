"""Rank-side task of the Gemma tests: one family at tp=2, loss parallel on or off, against one
device.

The tiny Gemma models (scaled embedding, ``1 + weight`` norms; Gemma-2's attention and
final-logit soft-caps small enough to bend these weights' values) are planned, verified
(which must issue no collective) and applied in both modes, then trained 2 AdamW steps next
to a single-device copy: loss, logits (gathered from their vocab shards under loss
parallel, by the test's own expectation of the layout) and every gradient are compared.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from hp_core import HpError, apply, plan, verify
from hp_core.testing.compare import (
    full_tensor,
    gather_full_grads,
    nan_safe_max,
    run_excess,
    snapshot_params,
    unmoved_params,
)
from hp_core.testing.families import build_family, family_batch
from hp_core.testing.probe import CollectiveCounter

RTOL = 1e-5
STEPS = 2
#: Negative controls: the sharded copies lose Gemma-2's final soft-cap, or Gemma-3's
#: embedding scale (the reference keeps both).
CONTROLS = (None, "no_final_softcap", "no_embedding_scale")


def _break(model: torch.nn.Module, control: str | None) -> None:
    if control == "no_final_softcap":
        model.config.final_logit_softcapping = None
    elif control == "no_embedding_scale":
        embed = model.get_submodule("model.embed_tokens")
        embed.scalar_embed_scale = 1.0
        embed.embed_scale.fill_(1.0)


def gemma_case(
    family: str, sp: bool, loss_parallel: bool, control: str | None = None
) -> dict[str, Any]:
    """Train ``family`` sharded and on one device; the worst excesses, or the refusal."""
    if control not in CONTROLS:
        raise ValueError(f"unknown control {control!r}")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    base = build_family(family, seed=0)
    try:
        p = plan(base, mesh, sequence_parallel=sp, loss_parallel=loss_parallel)
        with CollectiveCounter() as comm:
            report = verify(base, p, mesh)
    except HpError as e:
        return {"refused": type(e).__name__, "message": str(e)}
    models = {"ref": copy.deepcopy(base), "prod": copy.deepcopy(base), "val": copy.deepcopy(base)}
    apply(models["prod"], p, mesh, verify=report)
    apply(models["val"], p, mesh, mode="validate", verify=report)
    for k in ("prod", "val"):
        _break(models[k], control)
    # eps 1e-5, as the matrix: Adam divides by each element's own gradient, so an element
    # whose gradient is rounding noise on both sides would get a noise-sized update.
    opts = {
        k: torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-5, foreach=False)
        for k, m in models.items()
    }
    worst: dict[str, float] = {}
    local_vocab = 0
    unmoved: dict[str, set[str]] = {k: set() for k in models}
    for step in range(STEPS):
        ids = family_batch(family, seed=step)
        res = {}
        for k, m in models.items():
            opts[k].zero_grad(set_to_none=True)
            out = m(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            if k == "ref":
                grads = {n: q.grad for n, q in m.named_parameters()}
                logits = out.logits
            else:
                grads = gather_full_grads(m, models["ref"], mesh)
                sharded = {"tp": Shard(2)}
                logits = full_tensor(out.logits, sharded, mesh) if loss_parallel else out.logits
            if k == "prod":  # production's own logits: this rank's vocab shard under loss parallel
                local_vocab = int(out.logits.shape[-1])
            res[k] = (out.loss.detach(), logits.detach(), grads)
        for a, b in (("prod", "ref"), ("val", "ref"), ("prod", "val")):
            for what, value in run_excess(res[a], res[b], rtol=RTOL).items():
                key = f"{a}-{b}:{what}"
                worst[key] = nan_safe_max([worst.get(key, 0.0), value])
        for k, m in models.items():
            before = snapshot_params(m, only_with_grad=True)
            opts[k].step()
            unmoved[k].update(unmoved_params(before, m))
    return {
        "excess": worst,
        "unmoved": {k: sorted(v) for k, v in unmoved.items()},
        "n_grads": len(res["ref"][2]),
        "collectives": comm.total(),
        "local_vocab": local_vocab,
    }
