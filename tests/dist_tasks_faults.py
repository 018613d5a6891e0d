"""Rank-side tasks: faults injected into every phase of apply, on one rank or on all.

Every rank starts from *different* weights, so a rollback that restores parameter objects
but not their values (replication broadcasts rank 0's values) shows up as a mismatch.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import hp_core.runtime.verdict as V
from hp_core import plan as make_plan
from hp_core.apply import apply
from hp_core.presets import build_model
from hp_core.runtime.journal import Journal
from hp_core.verifier import verify
from tests._snapshots import differences, snapshot

A = importlib.import_module("hp_core.apply")  # the module (hp_core.apply is also the function)


def _model(rank: int) -> nn.Module:
    model = build_model("llama", attention_bias=True)
    with torch.no_grad():  # this rank's own weights
        g = torch.Generator().manual_seed(1000 + rank)
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return model


def _loss(model: nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids, use_cache=False).loss)


def _verified(rank: int, **plan_kwargs: Any) -> tuple[Any, nn.Module, Any, Any]:
    """``(tp=2 mesh, this rank's own model, its plan, the verifier's report)``."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = _model(rank)
    p = make_plan(model, mesh, **plan_kwargs)
    return mesh, model, p, verify(model, p, mesh)


class Fault:
    """Raise ``kind`` when the install enters ``phase`` (or reaches the ``at``-th module of it)."""

    def __init__(self, phase: str, kind: str, at: int | None = None) -> None:
        self.phase, self.kind, self.at = phase, kind, at
        self.count = 0
        self.saved: dict[str, Any] = {}

    def boom(self) -> None:
        if self.kind == "interrupt":
            raise KeyboardInterrupt(f"interrupted in {self.phase}")
        raise RuntimeError(f"injected failure in {self.phase}")

    def __enter__(self) -> Fault:
        fault = self
        if self.phase == "verify":
            self.saved["run_verifier"] = A.run_verifier

            def failing_verifier(*_a: Any, **_k: Any) -> Any:
                fault.boom()

            A.run_verifier = failing_verifier
            return self
        original_phase, original_at = Journal.phase, Journal.at
        self.saved["phase"], self.saved["at"] = original_phase, original_at

        def phase(journal: Journal, name: str) -> None:
            original_phase(journal, name)
            if name == fault.phase and fault.at is None:
                fault.boom()

        def at(journal: Journal, fqn: str) -> None:
            original_at(journal, fqn)
            if journal.current_phase == fault.phase and fault.at is not None:
                fault.count += 1
                if fault.count == fault.at:
                    fault.boom()

        Journal.phase, Journal.at = phase, at  # type: ignore[method-assign]
        return self

    def __exit__(self, *_exc: Any) -> None:
        if "run_verifier" in self.saved:
            A.run_verifier = self.saved["run_verifier"]
        else:
            Journal.phase, Journal.at = self.saved["phase"], self.saved["at"]  # type: ignore[method-assign]


def faults(phase: str, cases: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """For each ``(mode, who, kind)``: inject a fault in ``phase`` on rank 1 (``one``) or
    on every rank (``all``); report what each rank raised and whether its model is intact."""
    rank = dist.get_rank()
    mesh, model, p, report = _verified(rank, loss_parallel=True)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    loss_before = _loss(model, ids)
    out: list[dict[str, Any]] = []
    for mode, who, kind in cases:
        before = snapshot(model)
        # Part-way through the phase where it loops over modules (validate keeps head counts
        # global, so its attribute phase has none: there the fault is at the phase's start).
        at = (
            3 if phase == "boundaries" or (phase == "attributes" and mode == "production") else None
        )
        failing = who == "all" or rank == 1
        raised: BaseException | None = None
        t0 = time.perf_counter()
        try:
            if failing:
                with Fault(phase, kind, at):
                    apply(model, p, mesh, mode=mode, verify=True if phase == "verify" else report)
            else:
                apply(model, p, mesh, mode=mode, verify=True if phase == "verify" else report)
        except BaseException as e:
            raised = e
        elapsed = time.perf_counter() - t0
        diffs = differences(before, snapshot(model))
        out.append(
            {
                "case": (mode, who, kind),
                "failing": failing,
                "type": type(raised).__name__ if raised is not None else None,
                "message": str(raised) if raised is not None else "",
                "differences": diffs,
                "own_values": not diffs,
                "same_loss": _loss(model, ids) == loss_before,
                "applied": getattr(model, "_hp_applied", None) is not None,
                "elapsed": elapsed,
            }
        )
    return out


def success_then_values() -> dict[str, Any]:
    """A successful apply: every rank holds rank 0's values (DTensor's rule), while the
    tensors the caller held before apply still hold this rank's own values."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = _model(rank)
    norm = model.model.norm.weight
    own = norm.detach().clone()
    apply(model, make_plan(model, mesh), mesh)
    gathered = [torch.empty_like(own) for _ in range(2)]
    dist.all_gather(gathered, model.model.norm.weight.detach().contiguous())
    return {
        "caller_storage_intact": torch.equal(norm.detach(), own),
        "replicas_agree": torch.equal(gathered[0], gathered[1]),
    }


def divergent_settings(which: str) -> dict[str, Any]:
    """Ranks pass different behaviour-changing arguments: both refuse before touching anything."""
    rank = dist.get_rank()
    mesh, model, p, report = _verified(rank)
    before = snapshot(model)
    kwargs: dict[str, Any] = {"verify": report}
    if which == "mode":
        kwargs["mode"] = "validate" if rank == 1 else "production"
    elif which == "check_inputs":
        kwargs["check_inputs"] = rank == 0
    elif which == "plugins":
        original = A._settings

        def other_plugins(*a: Any) -> dict[str, str]:
            return {**original(*a), "plugins": "cp=hp-plugin-cp@9.9.9:loaded"}

        if rank == 1:
            A._settings = other_plugins
    try:
        apply(model, p, mesh, **kwargs)
        result: dict[str, Any] = {"type": None, "message": ""}
    except BaseException as e:
        result = {"type": type(e).__name__, "message": str(e)}
    finally:
        if which == "plugins" and rank == 1:
            A._settings = original
    result["untouched"] = not differences(before, snapshot(model))
    return result


def absent_rank(timeout: float) -> dict[str, Any]:
    """Rank 1 never calls apply: rank 0 raises within ``timeout`` instead of hanging."""
    rank = dist.get_rank()
    mesh, model, p, report = _verified(rank)
    before = snapshot(model)
    result: dict[str, Any] = {"type": None, "message": "", "elapsed": 0.0}
    if rank == 0:
        t0 = time.perf_counter()
        try:
            apply(model, p, mesh, verify=report, timeout=timeout)
        except BaseException as e:
            result = {"type": type(e).__name__, "message": str(e)}
        result["elapsed"] = time.perf_counter() - t0
    else:
        next(V._calls)  # keep this world's apply calls numbered alike on both ranks
    dist.barrier()
    result["untouched"] = not differences(before, snapshot(model))
    return result
