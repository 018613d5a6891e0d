"""``hp demo``: train a tiny real HF model on CPU ranks with tp x cp x ep and check every loss.

The parent process chooses a setup from the installed plugins (:func:`default_setup`),
spawns gloo ranks (:func:`rank_main`), and judges the per-step losses against a
single-process copy of the model trained on rank 0 (:func:`verdict`). Plugin-specific
training steps (cutting the batch for cp, summing gradients over cp) come from the
training adapters (:mod:`hp_core.training`), so the demo imports no plugin.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import queue
import re
import socket
import sys
import traceback
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch.distributed.device_mesh import init_device_mesh

from hp_core.apply import apply
from hp_core.errors import HpError
from hp_core.planner.plan import plan as plan_model
from hp_core.plans.prediction import input_check_axes, step_collectives
from hp_core.plugins import INNER_WRAPPER_REGISTRY, suggest_compute_factory
from hp_core.presets import build_model
from hp_core.testing.probe import CollectiveCounter
from hp_core.training import TrainingAdapters

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hp_core.mesh import MeshLike

__all__ = [
    "DemoSetup",
    "StepRow",
    "default_setup",
    "plan_summary",
    "rank_main",
    "run_demo",
    "verdict",
]

#: The presets the demo trains, with their HF architecture (for the suggested MoE compute).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
MODELS = tuple(ARCHITECTURES)
RTOL = ATOL = 1e-5
VOCAB = 128

_CP_OVERRIDE = """- match: "*.self_attn"
  when: cp
  inner_target: self
  inner_wrapper: sdpa_hf
  region_dispatch: false
"""
_EP_OVERRIDE = """- match: "model.layers.*.mlp"
  when: ep
  local_compute_fn: {factory}
  region_dispatch: false
"""


@dataclasses.dataclass(frozen=True)
class DemoSetup:
    """What every rank runs: the model, the mesh (outer axis first), ep, overrides, sizes."""

    model: str
    mesh: tuple[tuple[str, int], ...]
    ep: int = 1
    overrides: str = ""
    steps: int = 20
    batch: int = 2
    seq: int = 16
    notes: tuple[str, ...] = ()

    @property
    def world(self) -> int:
        n = 1
        for _, size in self.mesh:
            n *= size
        return n

    @property
    def mesh_text(self) -> str:
        return ",".join(f"{axis}={size}" for axis, size in self.mesh)


@dataclasses.dataclass(frozen=True)
class StepRow:
    step: int
    sharded: float
    single: float

    @property
    def diff(self) -> float:
        return abs(self.sharded - self.single)

    def ok(self, rtol: float = RTOL, atol: float = ATOL) -> bool:
        return self.diff <= atol + rtol * abs(self.single)


class DemoError(HpError, ValueError):
    """The demo cannot run as asked (bad mesh, missing plugin); the message says why."""


def parse_mesh(text: str) -> dict[str, int]:
    """``"tp=2,cp=2"`` → ``{"tp": 2, "cp": 2}``; only the axes the demo trains: tp and cp."""
    axes: dict[str, int] = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*(tp|cp)\s*=\s*(\d+)\s*", part)
        if not m or int(m.group(2)) < 1 or m.group(1) in axes:
            raise DemoError(
                f"--mesh: {part.strip()!r} is not tp=N or cp=N (each once), e.g. --mesh tp=2,cp=2"
            )
        axes[m.group(1)] = int(m.group(2))
    return axes


def default_setup(
    model: str = "qwen2moe",
    *,
    world: int | None = None,
    mesh: str | None = None,
    ep: int | None = None,
    steps: int = 20,
    batch: int = 2,
    seq: int = 16,
) -> DemoSetup:
    """The richest setup the loaded plugins allow; ``notes`` say what was left out and why."""
    notes: list[str] = []
    has_cp = "sdpa_hf" in INNER_WRAPPER_REGISTRY
    if mesh is not None:
        axes = parse_mesh(mesh)
        if axes.get("cp", 1) > 1 and not has_cp:
            raise DemoError(
                "--mesh has a cp axis, but no CP attention wrapper 'sdpa_hf' is registered: "
                "install hp-plugin-cp (pip install ./hp_plugin_cp) or check `hp plugins` and "
                "HP_PLUGINS."
            )
        if world is not None and world != axes.get("cp", 1) * axes.get("tp", 1):
            raise DemoError(
                f"--world {world} does not match --mesh {mesh} (its sizes multiply to "
                f"{axes.get('cp', 1) * axes.get('tp', 1)})"
            )
    elif has_cp:
        world = 4 if world is None else world
        axes = {"cp": 2, "tp": world // 2} if world % 2 == 0 and world >= 4 else {"tp": world}
    else:
        notes.append(
            "hp-plugin-cp is not loaded: no cp axis (its attention wrapper sdpa_hf is missing)"
        )
        if world is None:
            world = 2
            notes.append(
                "default mesh degraded to tp=2 on 2 ranks (the tiny models' 2 kv heads allow tp <= "
                "2)"
            )
        axes = {"tp": world}
    # cp outer, tp inner: each cp chunk is split contiguously over tp (docs/cp.md).
    dims = tuple((axis, axes[axis]) for axis in ("cp", "tp") if axis in axes)
    overrides = _CP_OVERRIDE if has_cp and axes.get("cp", 1) > 1 else ""

    architecture = ARCHITECTURES[model]
    is_moe = model in ("qwen2moe", "mixtral")
    factory = suggest_compute_factory(architecture) if is_moe else None
    if ep is None:
        ep = 2 if factory is not None else 1
        if is_moe and factory is None:
            notes.append(
                "hp-plugin-moe is not loaded: no expert parallelism (no compute factory for "
                f"{architecture})"
            )
    elif ep > 1 and factory is None:
        why = (
            "is not an MoE model"
            if not is_moe
            else f"has no compute factory ({architecture}): install hp-plugin-moe"
        )
        raise DemoError(f"--ep {ep}: {model} {why}.")
    if ep > 1:
        overrides += _EP_OVERRIDE.format(factory=factory)
    return DemoSetup(model, dims, ep, overrides, steps, batch, seq, tuple(notes))


def plan_for(setup: DemoSetup, model: Any, mesh: DeviceMesh | MeshLike) -> Any:
    """The demo's plan of ``model`` for ``mesh``: ``setup``'s ep size and overrides."""
    return plan_model(model, mesh, ep_size=setup.ep, overrides=setup.overrides or None)


def plan_summary(plan: Any) -> list[str]:
    """A few lines: boundaries per kind (FQN, layer numbers as ``*``), injections, collectives."""

    kinds: Counter[str] = Counter()
    extras: dict[str, set[str]] = {}
    for fqn, spec in plan.modules.items():
        if not spec.is_boundary:
            continue
        kind = re.sub(r"\.\d+(?=\.|$)", ".*", fqn) or "<root>"
        kinds[kind] += 1
        for label, value in (
            ("inner_wrapper", spec.inner_wrapper),
            ("local_compute_fn", spec.local_compute_fn),
        ):
            if value is not None:
                name = (
                    value
                    if isinstance(value, str)
                    else getattr(value, "target", None) or repr(value)
                )
                extras.setdefault(kind, set()).add(f"{label}={name}")
    lines = [f"{sum(kinds.values())} boundaries:"]
    for kind, n in kinds.items():
        extra = f"  [{', '.join(sorted(extras[kind]))}]" if kind in extras else ""
        lines.append(f"  {n} x {kind}{extra}")
    counts = step_collectives(
        plan.modules,
        loss_parallel=plan.loss_parallel,
        check_axes=input_check_axes(plan.mesh_axis_names, plan.mesh_shape or ()),
    )
    lines.append(
        "predicted collectives per step (the plan's boundaries; plugin compute adds its own):"
    )
    for phase in ("forward", "backward"):
        rows = sorted((op, axis, n) for (ph, op, axis), n in counts.items() if ph == phase)
        text = ", ".join(f"{n} {op} on {axis}" for op, axis, n in rows) or "none"
        lines.append(f"  {phase}: {text}")
    return lines


def measured_lines(measured: dict[str, dict[str, int]]) -> list[str]:
    """Rank 0's collectives in one training step, everything included."""
    lines = [
        "measured collectives per step on rank 0 (plan, plugin compute and training adapters):"
    ]
    for phase in ("forward", "backward"):
        calls = measured.get(phase, {})
        text = ", ".join(f"{n} {op}" for op, n in sorted(calls.items())) or "none"
        lines.append(f"  {phase}: {text}")
    return lines


def verdict(rows: list[StepRow], *, rtol: float = RTOL, atol: float = ATOL) -> int:
    """0 if there are rows and every step matches within ``atol + rtol * |single|``, else 1."""
    return 0 if rows and all(r.ok(rtol, atol) for r in rows) else 1


def _batch(setup: DemoSetup, step: int) -> dict[str, Any]:
    """A synthetic next-token batch (labels = inputs; the model shifts them)."""
    ids = torch.randint(
        0, VOCAB, (setup.batch, setup.seq), generator=torch.Generator().manual_seed(step)
    )
    return {"input_ids": ids, "labels": ids}


def train(rank: int, setup: DemoSetup, *, progress: bool) -> dict[str, Any]:
    """One rank: plan, apply (production), train; rank 0 also trains the single-process copy."""
    names = tuple(axis for axis, _ in setup.mesh)
    mesh = init_device_mesh("cpu", tuple(size for _, size in setup.mesh), mesh_dim_names=names)
    model = build_model(setup.model, seed=0)
    reference = copy.deepcopy(model) if rank == 0 else None
    plan = plan_for(setup, model, mesh)
    apply(model, plan, mesh, mode="production")
    adapters = TrainingAdapters.for_plan(plan, mesh, model=model)
    model = adapters.prepare_model(model)
    params = sum(p.numel() for p in model.parameters())
    # eps 1e-6: with the default 1e-8, Adam's first step divides by sqrt(v) ~ |g|, so grads
    # that differ by fp32 rounding (sharded vs unsharded sums) can move a weight by ±lr.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = (
        torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
        if reference is not None
        else None
    )
    losses: list[tuple[float, float]] = []
    measured: dict[str, dict[str, int]] = {}
    bar = _progress(setup.steps) if progress else None
    for step in range(setup.steps):
        batch = _batch(setup, step)
        # Step 0 counts every collective this rank issues: the plan's, the plugins' compute
        # and the training adapters'.
        with CollectiveCounter() as fwd:
            loss = model(**adapters.shard_batch(batch), use_cache=False).loss
        with CollectiveCounter() as bwd:
            loss.backward()
            adapters.after_backward(model)
        if step == 0:
            measured = {"forward": fwd.calls, "backward": bwd.calls}
        opt.step()
        opt.zero_grad(set_to_none=True)
        if reference is not None and ref_opt is not None:
            ref_loss = reference(**batch, use_cache=False).loss
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            losses.append((float(loss.detach()), float(ref_loss.detach())))
        if bar is not None:
            bar[0].advance(bar[1])
    if bar is not None:
        bar[0].stop()
    return {
        "rank": rank,
        "params": params,
        "losses": losses,
        "adapters": adapters.names,
        "measured": measured,
    }


def _progress(total: int) -> tuple[Any, Any]:
    """Rank 0's training progress bar on stderr (shown only on a terminal): ``(bar, task)``."""
    console = Console(file=sys.stderr)
    progress = Progress(
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    task = progress.add_task("train", total=total)
    progress.start()
    return progress, task


def rank_main(rank: int, world: int, port: int, setup: DemoSetup, results: Any) -> None:
    """Spawned target: join the gloo group, train, report ``(rank, ok, payload)`` on ``results``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        results.put((rank, True, train(rank, setup, progress=rank == 0)))
    except Exception:
        results.put((rank, False, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_demo(setup: DemoSetup, *, timeout: float = 300.0) -> list[dict[str, Any]]:
    """Spawn ``setup.world`` ranks and return their reports in rank order (DemoError on failure)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(r, setup.world, port, setup, results))
        for r in range(setup.world)
    ]
    for p in procs:
        p.start()
    reports: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        while len(reports) + len(failures) < setup.world:
            try:
                rank, ok, payload = results.get(timeout=timeout)
            except queue.Empty:
                raise DemoError(f"the ranks did not finish within {timeout:.0f} s") from None
            (reports if ok else failures)[rank] = payload
            if failures:
                break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        rank = min(failures)
        raise DemoError(f"rank {rank} failed:\n{failures[rank]}")
    return [reports[r] for r in range(setup.world)]
