"""Rank-side tasks of the hp-plugin-bloom tests (imported by the spawned gloo ranks).

A case plans the tiny, seeded, perturbed BLOOM of ``hp_core.testing.families`` on a tp
mesh, verifies the plan (which must issue no collective), applies it in both modes,
trains 2 AdamW steps next to a single-device copy and compares loss, logits and every
gradient (gathered without hp's tables) — or records the refusal.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from typing import Any

import hp_plugin_bloom.plugin as bloom_plugin
import torch
from hp_plugin_bloom.alibi import HeadSlicedAttention
from torch.distributed.device_mesh import init_device_mesh

from hp_core import HpError, apply, plan, verify
from hp_core.plugins import plugin_report, register_plugin, reset_plugins
from hp_core.testing.compare import (
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


@contextlib.contextmanager
def plugins(with_bloom: bool) -> Iterator[None]:
    """The registries with (entry point or by hand) or without hp-plugin-bloom."""
    saved = os.environ.get("HP_DISABLE_PLUGIN_AUTOLOAD")
    if not with_bloom:
        os.environ["HP_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    reset_plugins()
    try:
        if with_bloom and not any(
            r.name == "bloom" and r.status == "loaded" for r in plugin_report()
        ):
            register_plugin(bloom_plugin, name="bloom")  # not pip-installed: load it by hand
        yield
    finally:
        if saved is None:
            os.environ.pop("HP_DISABLE_PLUGIN_AUTOLOAD", None)
        else:
            os.environ["HP_DISABLE_PLUGIN_AUTOLOAD"] = saved
        reset_plugins()


def _contiguous_rows(self: Any, alibi: torch.Tensor, batch: int, total: int, heads: int) -> Any:
    """The negative control: a contiguous chunk of dim 0 — what ``alibi: {tp: shard(0)}``
    would give a rank — instead of its heads' rows."""
    n = alibi.shape[0] // self.size
    return alibi[self.rank * n : (self.rank + 1) * n]


def _train(models: dict[str, Any], mesh: Any) -> dict[str, Any]:
    opts = {
        k: torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-5, foreach=False)
        for k, m in models.items()
    }
    ref = models["ref"]
    worst: dict[str, float] = {}
    unmoved: dict[str, set[str]] = {k: set() for k in models}
    n_grads = 0
    for step in range(STEPS):
        ids = family_batch("bloom", seed=step)
        res: dict[str, Any] = {}
        for k, m in models.items():
            opts[k].zero_grad(set_to_none=True)
            out = m(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            grads = (
                {n: p.grad for n, p in m.named_parameters()}
                if k == "ref"
                else gather_full_grads(m, ref, mesh)
            )
            res[k] = (out.loss.detach(), out.logits.detach(), grads)
        n_grads = len(res["ref"][2])
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
        "n_grads": n_grads,
    }


def bloom_case(
    tp: int, sp: bool, *, with_plugin: bool = True, control: str | None = None, **config: Any
) -> dict[str, Any]:
    """Plan, verify, apply both modes and train BLOOM on ``tp`` ranks; or the refusal."""
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    base = build_family("bloom", seed=0, **config)
    names = [n for n, _ in base.named_modules() if n]
    with plugins(with_plugin), contextlib.ExitStack() as stack:
        if control == "contiguous_rows":
            stack.enter_context(_patched(HeadSlicedAttention, "_rows", _contiguous_rows))
        try:
            p = plan(base, mesh, sequence_parallel=sp)
            with CollectiveCounter() as comm:
                report = verify(base, p, mesh)
        except HpError as e:
            return {
                "refused": type(e).__name__,
                "message": str(e)[:1500],
                "names_module": any(n in str(e) for n in names),
            }
        wrapped = sorted(f for f, s in p.items() if s.inner_wrapper is not None)
        models = {
            "ref": copy.deepcopy(base),
            "prod": copy.deepcopy(base),
            "val": copy.deepcopy(base),
        }
        apply(models["prod"], p, mesh, verify=report)
        apply(models["val"], p, mesh, mode="validate", verify=report)
        qkv = models["prod"].transformer.h[0].self_attention.query_key_value.weight
        result = _train(models, mesh)
    return {**result, "collectives": comm.total(), "wrapped": wrapped, "qkv_rows": qkv.shape[0]}


@contextlib.contextmanager
def _patched(cls: type, name: str, value: Any) -> Iterator[None]:
    before = cls.__dict__[name]
    setattr(cls, name, value)
    try:
        yield
    finally:
        setattr(cls, name, before)
