"""Rank-side tasks for apply's verification (importable by the spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from hp_core import VerifyReport, apply, plan, verify
from hp_core.testing.families import build_family
from tests._qk_norm_helpers import without_full_width_norms


def _mesh() -> Any:
    return init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def apply_keeps_report() -> dict[str, Any]:
    m = build_family("llama", num_hidden_layers=1)
    mesh = _mesh()
    p = plan(m, mesh)
    apply(m, p, mesh)
    report = m._hp_applied.report
    other = build_family("llama", num_hidden_layers=1)
    apply(other, plan(other, mesh), mesh, verify=verify(other, plan(other, mesh), mesh))
    # a report saved by an earlier run stands in for the verifier
    saved = report.dumps()
    third = build_family("llama", num_hidden_layers=1)
    apply(third, plan(third, mesh), mesh, verify=VerifyReport.loads(saved))
    return {
        "partial": {k: list(v) for k, v in report.partial().items()},
        "same_report": other._hp_applied.report.partial()
        == report.partial()
        == third._hp_applied.report.partial(),
    }


def apply_verify_error(case: str) -> dict[str, Any]:
    family = "olmo2" if case == "refused" else "llama"
    m = build_family(family, num_hidden_layers=1)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    mesh = _mesh()
    with without_full_width_norms():  # OLMo-2 as the planner got it wrong before
        p = plan(m, mesh)
    arg: Any = {"false": False, "nonsense": "yes", "refused": True}.get(case)
    if case == "other_plan":
        arg = verify(m, plan(m, mesh, sequence_parallel=False), mesh)
    try:
        apply(m, p, mesh, verify=arg)
        out = {"type": None, "message": ""}
    except Exception as e:
        out = {"type": type(e).__name__, "message": str(e)}
    out["untouched"] = getattr(m, "_hp_applied", None) is None and all(
        torch.equal(before[n], q) and not hasattr(q, "to_local") for n, q in m.named_parameters()
    )
    return out


def validate_catches_what_a_wrong_report_lets_through(case: str) -> dict[str, Any]:
    """Validate mode checks by itself: given a report that skips the verifier's findings, it
    still refuses undeclared communication (forward) and a partial gradient nothing sums."""
    import dataclasses

    family = {"undeclared": "olmo2", "unreduced": "qwen3"}[case]
    m = build_family(family, num_hidden_layers=1)
    mesh = _mesh()
    with without_full_width_norms():  # OLMo-2 as the planner got it wrong before
        p = plan(m, mesh)
    clean = verify(
        build_family("llama", num_hidden_layers=1),
        plan(build_family("llama", num_hidden_layers=1), mesh),
        mesh,
    )
    lying = dataclasses.replace(clean, fingerprint=p.fingerprint(), reductions=())
    apply(m, p, mesh, mode="validate", verify=lying)
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    try:
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": ""}
