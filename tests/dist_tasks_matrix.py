"""Rank-side tasks of the differential matrix: every family either matches one device or is refused.

A case plans a tiny, seeded, perturbed Hugging Face model for tp=2, verifies the plan (which
must issue no collective), applies it in both modes, trains 2 AdamW steps next to a
single-device copy and compares loss, logits and every gradient (gathered without hp's
tables) — or records the refusal. A refusal that proposes an override is followed: the
override is applied and the case runs again, until it matches or is refused without a
further proposal.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate

from hp_core import HpError, apply, plan, verify
from hp_core.testing.compare import (
    GradientCheckError,
    allclose_excess,
    gather_full_grads,
    grads_excess,
    nan_safe_max,
    snapshot_params,
    unmoved_params,
)
from hp_core.testing.families import build_family, family_batch
from hp_core.testing.family_matrix import FAMILIES_MATRIX
from hp_core.testing.fused import restore_fused
from hp_core.testing.printed_fix import printed_fix
from hp_core.testing.probe import CollectiveCounter
from hp_core.testing.refusal_check import refusal_problems

RTOL = 1e-5
STEPS = 2


def proposed_overrides(message: str) -> list[dict[str, Any]] | None:
    """The override entries of the fix a refusal prints (None: it prints none, or its fix is
    only turning sequence parallelism off, which a case at a fixed setting cannot follow)."""
    fix = printed_fix(message)
    return fix.overrides if fix is not None and fix.overrides else None


#: The last single-device run, by what it ran: the sp and no-sp cases of a family (and the
#: rounds of a followed fix) train the same reference, so it is trained once. Keyed by the
#: model's every parameter (name, shape, sum), not by a name, so a model built differently
#: is trained again.
_REFERENCE: dict[tuple[Any, ...], tuple[list[Any], set[str], dict[str, Any]]] = {}


def _reference_key(family: str, ref: Any) -> tuple[Any, ...]:
    with torch.no_grad():
        params = ref.named_parameters()
        return (
            family,
            *((n, tuple(p.shape), str(p.dtype), float(p.double().sum())) for n, p in params),
        )


def _train(models: dict[str, Any], family: str, mesh: Any, batch: Any = None) -> dict[str, Any]:
    """``batch(seed)`` gives the input ids of a step (default: the family's own batch, and the
    reference run is shared with the family's previous case)."""
    ref_key = _reference_key(family, models["ref"]) if batch is None else None
    cached = _REFERENCE.get(ref_key) if ref_key is not None else None
    if cached is not None:
        models = {k: m for k, m in models.items() if k != "ref"}
    ref_steps: list[Any] = cached[0] if cached is not None else []
    # Adam divides each update by that element's own gradient size: an element whose gradient
    # is rounding noise in both runs (an embedding row no token used, a bias whose gradient is
    # mathematically zero) gets a noise-driven update of up to lr * |noise| / eps. eps 1e-5
    # keeps that far below the tolerance; what is compared before any step is unaffected.
    opts = {
        k: torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-5, foreach=False)
        for k, m in models.items()
    }
    ref = models.get("ref")
    # what gather_full_grads reads the full shapes off: the model, or the cached run's shapes
    full: Any = ref if ref is not None else cached[2] if cached is not None else None
    worst: dict[str, float] = {}
    unmoved: dict[str, set[str]] = {k: set() for k in models}
    if cached is not None:
        unmoved["ref"] = set(cached[1])
    for step in range(STEPS):
        ids = batch(step) if batch is not None else family_batch(family, seed=step)
        res: dict[str, Any] = {"ref": ref_steps[step]} if cached is not None else {}
        for k, m in models.items():
            opts[k].zero_grad(set_to_none=True)
            out = m(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            # Only the parameters that got a gradient (a frozen router bias, or an indexer
            # behind a top-k, gets none on either side; gather_full_grads skips them too).
            grads = (
                {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
                if k == "ref"
                else restore_fused(
                    gather_full_grads(m, full, mesh),
                    m._hp_applied.plan,
                    mesh.size(),
                )
            )
            res[k] = (out.loss.detach(), out.logits.detach(), grads)
        if cached is None:
            ref_steps.append(res["ref"])
        for a, b in (("prod", "ref"), ("val", "ref"), ("prod", "val")):
            for what, i in (("loss", 0), ("logits", 1)):
                key = f"{a}-{b}:{what}"
                worst[key] = nan_safe_max(
                    [worst.get(key, 0.0), allclose_excess(res[a][i], res[b][i], rtol=RTOL)]
                )
            key = f"{a}-{b}:grad"  # inf when the gradient names differ
            worst[key] = nan_safe_max(
                [worst.get(key, 0.0), grads_excess(res[a][2], res[b][2], rtol=RTOL)]
            )
        for k, m in models.items():
            before = snapshot_params(m, only_with_grad=True)
            opts[k].step()
            unmoved[k].update(unmoved_params(before, m))  # not moved, or moved to NaN/inf
            if not before:
                unmoved[k].add("<no parameter had a gradient>")
    if ref_key is not None and cached is None:
        _REFERENCE.clear()  # one reference held at a time
        shapes = {n: tuple(p.shape) for n, p in models["ref"].named_parameters()}
        _REFERENCE[ref_key] = (ref_steps, unmoved["ref"], shapes)
    return {
        "excess": worst,
        "unmoved": {k: sorted(v) for k, v in unmoved.items()},
        "n_grads": len(res["ref"][2]),
    }


def run_case(
    family: str,
    sp: bool,
    overrides: list[dict[str, Any]] | None = None,
    control: str | None = None,
    ep: int = 1,
) -> dict[str, Any]:
    """One attempt: plan, verify, apply both modes, train; or the refusal and where it came from."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dtype = getattr(torch, FAMILIES_MATRIX[family].compare_dtype)
    base = build_family(family, seed=0, dtype=dtype)
    if control == "lie_about_input":
        # the final norm says its input arrives whole while it arrives sequence-sharded
        whole = {"hidden_states": {"tp": Replicate()}}
        overrides = [*(overrides or []), {"match": "model.norm", "in_src": whole, "in_dst": whole}]
    names = [n for n, _ in base.named_modules() if n]

    def refusal(where: str, e: HpError, **extra: Any) -> dict[str, Any]:
        msg = str(e)
        return {
            "refused": where,
            "type": type(e).__name__,
            "message": msg,
            "names_module": any(n in msg for n in names),
            "problems": refusal_problems(msg, names),
            **extra,
        }

    try:
        p = plan(base, mesh, sequence_parallel=sp, overrides=overrides, ep_size=ep)
    except HpError as e:
        return refusal("plan", e)
    with CollectiveCounter() as comm:  # what verifying costs in real collectives: none
        try:
            report = verify(base, p, mesh)
        except HpError as e:
            return refusal("verify", e, collectives=comm.total())
    models = {"ref": copy.deepcopy(base), "prod": copy.deepcopy(base), "val": copy.deepcopy(base)}
    apply(models["prod"], p, mesh, verify=report)
    apply(models["val"], p, mesh, mode="validate", verify=report)
    if control == "no_reductions":  # the runtime forgets the derived gradient sums
        for k in ("prod", "val"):
            models[k]._hp_applied.grad_reducer.buckets = []
    try:
        result = _train(models, family, mesh)
    except (
        GradientCheckError,
        HpError,
    ) as e:  # caught by the comparison or by validate's own checks
        return {"caught": type(e).__name__, "message": str(e)[:2000]}
    return {**result, "collectives": comm.total(), "partial": len(report.reductions)}


def family_case(family: str, sp: bool, control: str | None = None, ep: int = 1) -> dict[str, Any]:
    """A case and the fixes its refusals print, each followed as a user would (its overrides
    added, sequence parallelism turned off where the fix says so; at most 4 rounds)."""
    t0 = time.perf_counter()
    overrides: list[dict[str, Any]] = []
    rounds = []
    for _ in range(4):
        r = run_case(family, sp, overrides or None, control, ep=ep)
        rounds.append(
            {
                k: v
                for k, v in r.items()
                if k in ("refused", "type", "message", "caught", "names_module", "problems")
            }
        )
        if "refused" not in r:
            break
        fix = printed_fix(r["message"])
        if fix is None:
            break
        new = [e for e in fix.overrides if e not in overrides]
        sp_off = sp and fix.flags.get("sequence_parallel") is False
        if not new and not sp_off:  # a printed fix, followed, did not hold: test_matrix fails
            r["fix_did_not_hold"] = True
            break
        overrides += new
        sp = sp and not sp_off
    r["rounds"] = rounds
    r["fixes"] = overrides
    r["sequence_parallel"] = sp
    r["seconds"] = time.perf_counter() - t0
    return r
