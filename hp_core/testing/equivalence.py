"""The one-call equivalence check: a sharded model against one device, in both modes.

:func:`check_equivalence` runs :func:`~hp_core.testing.equivalence_rank.equivalence_on_rank`
on every rank of a gloo :class:`~hp_core.testing.world.World` and returns one
:class:`~hp_core.testing.equivalence_report.EquivalenceReport`, or raises
:class:`~hp_core.testing.equivalence_report.EquivalenceError` on the test process naming
the mode, step, quantity, worst tensor with its placements, excess and tolerance. The
arguments are checked here first, so a bad one fails before any rank starts; a plan or
apply refusal on the ranks is re-raised as the ``HpError`` it is.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hp_core import HpError, MeshSpec, ShardingPlan
from hp_core.testing.equivalence_rank import (
    MODES,
    Factory,
    check_run_args,
    equivalence_on_rank,
    mesh_spec,
    resolve_factory,
)
from hp_core.testing.equivalence_report import (
    EquivalenceError,
    EquivalenceFactoryError,
    EquivalenceReport,
    EquivalenceRunError,
)
from hp_core.testing.world import World, WorldTaskError, get_world

__all__ = ["check_equivalence"]


def _picklable(value: object, what: str) -> None:
    if value is None or isinstance(value, str):
        return
    try:
        pickle.dumps(value)
    except Exception as e:
        raise EquivalenceFactoryError(
            f"{what} {value!r} cannot be sent to the ranks (not picklable: {e}). "
            "Fix: define it at module level in an importable module, or pass 'pkg.mod:fn'."
        ) from None


def _rank_task(*args: Any, **kwargs: Any) -> EquivalenceReport:
    return equivalence_on_rank(*args, raise_on_failure=False, **kwargs)


def _refusal(err: WorldTaskError) -> BaseException | None:
    """The rank-side exception to re-raise as itself: an HpError or an EquivalenceError."""
    for rank in sorted(err.exceptions):
        exc = err.exceptions[rank]
        if isinstance(exc, (HpError, EquivalenceError)):
            return exc
    return None


def check_equivalence(
    model_factory: Factory,
    batch_factory: Factory,
    mesh: MeshSpec | Mapping[str, int] | str = "tp=2",
    *,
    overrides: Any = None,
    plan_kwargs: Mapping[str, Any] | None = None,
    modes: Sequence[str] = MODES,
    steps: int = 2,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    world: World | None = None,
    shard_batch: Callable[[dict[str, Any], DeviceMesh], dict[str, Any]] | None = None,
    plan_hook: Callable[[ShardingPlan], ShardingPlan | None] | None = None,
    after_apply: Callable[[nn.Module, str], None] | None = None,
    timeout: float | None = None,
) -> EquivalenceReport:
    """Train the parallelized model next to a single-device copy; raise unless they match.

    ``model_factory`` is a zero-argument module-level callable (or ``"pkg.mod:fn"``) that
    builds the same seeded model on every call; ``batch_factory(step)`` returns the
    model's keyword arguments for that step. The model's output needs ``.loss`` (HF style)
    unless ``loss_fn(output, batch)`` is given; its ``.logits`` (or the output itself, when
    it is a tensor) are compared whole. ``mesh`` is hp's mesh text (``"tp=2"``,
    ``"tp=2,ep=2"``) or a mapping; the world has as many ranks as the mesh (``world``
    reuses one, default ``get_world(size)``). ``overrides`` and ``plan_kwargs`` go to
    :func:`hp_core.plan`. ``shard_batch``, ``plan_hook`` and ``after_apply``: see
    :func:`~hp_core.testing.equivalence_rank.equivalence_on_rank`.

    Per step and mode: loss, logits, every gradient; after the last step every parameter;
    also production against validate, and that every parameter with a gradient moved. A
    tensor passes when ``|got - ref| <= atol + rtol * |ref|`` element-wise (docs/testing.md).
    """
    check_run_args(steps, modes)
    spec = mesh_spec(mesh, world.world_size if world is not None else None)
    for factory, what in ((model_factory, "model factory"), (batch_factory, "batch factory")):
        resolve_factory(factory, what)
        _picklable(factory, what)
    for hook, what in (
        (loss_fn, "loss_fn"),
        (shard_batch, "shard_batch"),
        (plan_hook, "plan_hook"),
        (after_apply, "after_apply"),
    ):
        _picklable(hook, what)
    w = world if world is not None else get_world(spec.world_size)
    kwargs = {
        "overrides": overrides,
        "plan_kwargs": dict(plan_kwargs or {}),
        "modes": tuple(modes),
        "steps": steps,
        "rtol": rtol,
        "atol": atol,
        "loss_fn": loss_fn,
        "shard_batch": shard_batch,
        "plan_hook": plan_hook,
        "after_apply": after_apply,
    }
    try:
        reports = w.run(
            _rank_task, model_factory, batch_factory, str(spec), timeout=timeout, **kwargs
        )
    except WorldTaskError as e:
        cause = _refusal(e)
        if isinstance(cause, EquivalenceRunError):
            raise cause from e  # the model's own failure: keep the ranks' tracebacks
        if cause is not None:
            raise cause from None
        raise
    # Every rank compared its own run with its own reference: a mismatch on any one of
    # them (replicas that diverged, a rank-local bug) fails the check, not only rank 0's.
    for report in reports:
        if not report.passed:
            raise EquivalenceError(report)
    first: EquivalenceReport = reports[0]
    return first
