"""Shared helpers for the planner tests: builtin-only plugin state, layouts, spec views."""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from hp_core.plugins import ENV_DISABLE_AUTOLOAD, ENV_PLUGINS, ENV_STRICT, reset_plugins
from hp_core.spec import ModuleShardingSpec, parse_placement

R, P, S0, S1, S2 = Replicate(), Partial(), Shard(0), Shard(1), Shard(2)


@pytest.fixture
def builtin_only(monkeypatch: pytest.MonkeyPatch):
    """Plan with the core's own templates only (no installed plugin can change the result)."""
    for var in (ENV_PLUGINS, ENV_STRICT):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, "1")
    reset_plugins()
    yield
    reset_plugins()


def L(**axes: str) -> dict[str, Any]:
    """A named layout from DSL text: ``L(tp="shard(1)", cp="shard(1)")``."""
    return {axis: parse_placement(text) for axis, text in axes.items()}


def contract(spec: ModuleShardingSpec) -> dict[str, Any]:
    """The parts of a spec a test pins: the five layouts always, the rest only when set."""
    out: dict[str, Any] = {
        f: getattr(spec, f) for f in ("params", "in_src", "in_dst", "out_src", "out_dst")
    }
    for f in (
        "out_names",
        "tp_divide_attrs",
        "region_dispatch",
        "inner_target",
        "inner_wrapper",
        "local_compute_fn",
    ):
        if getattr(spec, f) is not None:
            out[f] = getattr(spec, f)
    if not spec.is_boundary:
        out["is_boundary"] = False
    for f in ("_deferred_bias_params", "_is_terminal", "_needs_cp_attn", "_ep_stack", "_ep_size"):
        if getattr(spec, f):
            out[f] = getattr(spec, f)
    if spec._tp_local_attr_plan is not None:
        out["_tp_local_attr_plan"] = spec._tp_local_attr_plan
    return out


def io(name: str, layout: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: layout}
