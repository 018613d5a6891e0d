"""Rank-side tasks for tuple outputs seen by the trace and a final norm handed over whole.

Each task plans a tiny family for tp=2, verifies, applies both modes and trains next to a
single-device copy (:func:`tests.dist_tasks_matrix.run_case`), or records the refusal. The
negative controls plan with what the trace saw withheld (the tuple output named from the
annotation, the final norm left sequence-sharded), or hand boundary outputs out as the
view ``DTensor.to_local`` makes, and must be refused.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hp_core import HpError, plan, verify
from hp_core.planner import structure
from hp_core.runtime import layouts
from hp_core.testing.families import build_family
from tests import dist_tasks_matrix
from tests.dist_tasks_matrix import run_case

CONTROLS = ("no_trace_outputs", "to_local_views")


def _summary(r: dict[str, Any]) -> dict[str, Any]:
    keep = ("refused", "type", "caught", "collectives", "n_grads", "unmoved")
    out = {k: r[k] for k in keep if k in r}
    if "message" in r:
        out["message"] = r["message"][:600]
    if "excess" in r:
        out["excess"] = r["excess"]
    return out


def _to_local(dt: DTensor, grad: Any = None) -> torch.Tensor:
    return dt.to_local(grad_placements=grad)


@contextmanager
def _control(name: str | None) -> Iterator[None]:
    if name is None:
        yield
    elif name == "no_trace_outputs":  # tuple-ness from the annotation, final norm sharded
        with mock.patch.object(structure, "_mark_outputs", lambda blocks, flows: None):
            yield
    elif name == "to_local_views":  # boundary outputs as the custom-Function view
        with mock.patch.object(layouts, "unwrap", _to_local):
            yield
    else:
        raise ValueError(name)


def cases(items: list[tuple[str, bool]], control: str | None = None) -> dict[str, Any]:
    """``{"family/sp": summary}``: zero-config (no override) cases, each trained 2 steps."""
    out = {}
    with _control(control):
        for family, sp in items:
            out[f"{family}/{'sp' if sp else 'nosp'}"] = _summary(run_case(family, sp))
    return out


def variant_case(family: str, sp: bool, config: dict[str, Any]) -> dict[str, Any]:
    """A zero-config case of ``family`` built with ``config`` overrides."""
    build = functools.partial(build_family, **config)
    with mock.patch.object(dist_tasks_matrix, "build_family", build):
        return _summary(run_case(family, sp))


def whole_attention_case(family: str, sp: bool) -> dict[str, Any]:
    """A case with every attention block kept whole on tp (the multi-query refusal's fix)."""
    model = build_family(family, seed=0)
    names = [n for n, m in model.named_modules() if n.endswith(".attn")]
    overrides = [
        {
            "match": n,
            "params": {
                rel: {"tp": "replicate"} for rel, _ in model.get_submodule(n).named_parameters()
            },
            "out_src": {"attn_output": {"tp": "replicate"}},
        }
        for n in names
    ]
    return _summary(run_case(family, sp, overrides))


def refusal(family: str, sp: bool, **config: Any) -> dict[str, Any]:
    """Plan + verify a family built with ``config`` overrides: ``{}`` or the refusal."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = build_family(family, seed=0, **config)
    try:
        verify(model, plan(model, mesh, sequence_parallel=sp), mesh)
    except HpError as e:
        return {"type": type(e).__name__, "message": str(e)[:600]}
    return {}
