"""The derived gradient reductions: sum every partial gradient over the axes it is partial on.

Which gradients are partial is not decided here: the verifier derives it from the plan's
placements and a propagation pass (``hp_core.verifier``), and expert parallelism from its
expert layout. This module only carries it out, once per backward, and so that it
survives what wraps the model afterwards:

* Parameters are named ``(owning module, attribute)``, never held as objects, so that
  FSDP2 replacing the parameter objects (or anything else that does) changes nothing:
  at reduction time hp reduces the gradient of whatever parameter is there.
* The reduction runs at the very end of backward, after every callback queued during
  backward — FSDP2's final gradient reduce-scatter and DDP's bucket copy-back included
  (hp queues a callback that queues the reduction, so it lands after theirs). Sums
  commute, so reducing over tp after data parallelism reduced over dp is exact.
* When nothing else manages the gradients (no DDP forward active, parameters unchanged
  since apply), a bucket's all-reduce starts as soon as its last gradient has arrived and
  overlaps the rest of backward; the end of backward only waits for it, and if anything
  changed those gradients in between, the early result is dropped and recomputed.

One flat all-reduce per process group per step (buckets are capped at 25 MB, so a big
bucket — context parallelism reduces every parameter — splits into a few). Gradient
accumulation works: what was already reduced before this backward is kept aside.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor, Partial, Replicate

from hp_core.errors import HpError
from hp_core.runtime.journal import Journal
from hp_core.runtime.nested import tensors_in

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["BUCKET_BYTES", "GradReducer", "GradReduction", "UnreducedGradientError"]

#: Largest flat buffer one all-reduce carries.
BUCKET_BYTES = 25 * 1024 * 1024


class UnreducedGradientError(HpError, RuntimeError):
    """Validate mode: a gradient is still partial after backward and nothing reduces it."""


@dataclasses.dataclass(frozen=True)
class GradReduction:
    """This rank's gradient of ``param`` (an FQN) is a partial sum over ``axes``.

    ``axes`` are mesh axis names; ``group`` overrides the process group (expert replicas,
    whose groups are not mesh axes), and ``axes`` then holds one label for it.
    ``source`` says how hp knows: ``"propagation"`` (the verifier's DTensor pass),
    ``"contract"`` (the boundary's declared layouts) or ``"experts"``.
    """

    param: str
    axes: tuple[str, ...]
    source: str = "propagation"
    group: ProcessGroup | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass
class _Entry:
    name: str
    owner: nn.Module
    attr: str
    source: str = "propagation"
    initial: Any = None  # the parameter object at apply time

    def __post_init__(self) -> None:
        if self.initial is None:
            self.initial = self.owner._parameters.get(self.attr)

    def param(self) -> torch.Tensor | None:
        return self.owner._parameters.get(self.attr)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _like(
    ref: torch.Tensor, value: torch.Tensor, placements: Sequence[Any], axis: str
) -> torch.Tensor:
    """``value`` as a gradient of ``ref``'s kind: a DTensor whose ``axis`` placement is summed."""
    if not isinstance(ref, DTensor):
        return value
    names = list(ref.device_mesh.mesh_dim_names or ())
    summed = [
        Replicate() if isinstance(pl, Partial) and n == axis else pl
        for n, pl in zip(names, placements, strict=True)
    ]
    return DTensor.from_local(value, ref.device_mesh, summed, run_check=False)


class _Bucket:
    """Parameters reduced together over one process group."""

    def __init__(self, key: str, group: ProcessGroup, entries: list[_Entry]) -> None:
        self.key = key
        self.group = group
        self.entries = entries
        self.early_ok = True  # False when a parameter is also in another bucket
        self.reset()

    def reset(self) -> None:
        self.base: dict[int, torch.Tensor | None] = {}
        self.waiting: set[int] = set()
        self.work: Any = None
        self.flat: torch.Tensor | None = None
        self.seen: list[tuple[Any, int]] = []

    # -- one backward ------------------------------------------------------------
    def arm(self) -> None:
        self.reset()
        for i, e in enumerate(self.entries):
            p = e.param()
            g = None if p is None or p.grad is None else _local(p.grad)
            self.base[i] = None if g is None else g.detach().clone()
        self.waiting = set(range(len(self.entries)))

    def whole_already(self, p: torch.Tensor | None) -> bool:
        """A DTensor gradient no longer partial here: something (FSDP2) already summed it."""
        g = None if p is None else p.grad
        if not isinstance(g, DTensor):
            return False
        names = list(g.device_mesh.mesh_dim_names or ())
        return self.key in names and not isinstance(g.placements[names.index(self.key)], Partial)

    def deltas(self) -> list[torch.Tensor]:
        out = []
        for i, e in enumerate(self.entries):
            p = e.param()
            g = None if p is None or p.grad is None else _local(p.grad)
            base = self.base.get(i)
            if g is not None and self.whole_already(p):
                out.append(
                    torch.zeros_like(g)
                )  # same element count on every rank; not written back
            elif g is None:
                # Every rank must send the same number of elements: a missing gradient is zeros.
                shape = (
                    base.shape if base is not None else (_local(p).shape if p is not None else (0,))
                )
                ref = base if base is not None else (_local(p) if p is not None else torch.empty(0))
                out.append(torch.zeros(shape, dtype=ref.dtype, device=ref.device))
            else:
                out.append(g.detach() - base if base is not None else g.detach())
        return out

    def start_early(self) -> None:
        """All gradients arrived and nothing else owns them: start the all-reduce now."""
        news = self.deltas()
        self.seen = [(e.param().grad, e.param().grad._version) for e in self.entries]  # type: ignore[union-attr]
        self.flat = torch.cat([n.reshape(-1) for n in news])
        self.work = dist.all_reduce(self.flat, group=self.group, async_op=True)

    def finish(self) -> int:
        """Reduce (or collect the early reduction) and write the gradients back; 1 if it ran."""
        if self.work is not None:
            self.work.wait()
            unchanged = all(
                e.param() is not None and e.param().grad is g and g._version == v  # type: ignore[union-attr]
                for e, (g, v) in zip(self.entries, self.seen, strict=True)
            )
            if not unchanged:  # something rewrote them after hp snapshot them: do it again
                self.work = self.flat = None
        if self.work is None:
            news = self.deltas()
            self.flat = torch.cat([n.reshape(-1) for n in news])
            dist.all_reduce(self.flat, group=self.group)
        offset = 0
        for i, e in enumerate(self.entries):
            p = e.param()
            base = self.base.get(i)
            if p is None:
                continue
            n = _local(p).numel() if p.grad is None else _local(p.grad).numel()
            if self.flat is None:  # reduced above, or by the early start of .work
                raise RuntimeError("GradReducer: a bucket finished without its buffer (hp bug).")
            reduced = self.flat[offset : offset + n]
            offset += n
            if not self.whole_already(p):
                self._write(p, reduced, base, self.key)
        self.reset()
        return 1

    @staticmethod
    def _write(
        p: torch.Tensor, reduced: torch.Tensor, base: torch.Tensor | None, axis: str
    ) -> None:
        g = p.grad
        value = reduced.view(_local(g).shape if g is not None else _local(p).shape)
        if base is not None:
            value = value + base
        if g is None:
            p.grad = _like(
                p, value.contiguous(), p.placements if isinstance(p, DTensor) else (), axis
            )
        elif isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
            p.grad = _like(
                g, value.contiguous(), g.placements, axis
            )  # summed over axis: whole there
        else:
            _local(g).copy_(value)  # in place: a DDP bucket view or an FSDP shard stays what it was


class GradReducer:
    """Carries out a list of :class:`GradReduction` on every backward of one model."""

    def __init__(
        self, buckets: list[_Bucket], mode: str, watched: list[_Entry], every: list[_Entry]
    ) -> None:
        self.buckets = buckets
        self.mode = mode
        self.watched = watched
        #: Validate mode: every parameter, checked for a gradient nothing reduced.
        self.every = every
        self.reductions = 0  # buckets reduced so far (tests count them)
        self.early = 0  # of those, started before the end of backward
        self.by_group: dict[
            str, int
        ] = {}  # the same, per process group (axis name or expert label)
        self._armed = False
        self._queued = False
        self._dirty = False
        self._exclusive = False
        self._objects: dict[int, torch.Tensor] = {}
        self._hooks: dict[int, Any] = {}
        self._initial: list[torch.Tensor | None] = [e.param() for e in watched]

    @classmethod
    def build(
        cls, model: nn.Module, reductions: Iterable[GradReduction], mesh: DeviceMesh, mode: str
    ) -> GradReducer:
        """Bucket the reductions by process group (in the given order, identical on every rank)."""
        by_key: dict[str, tuple[Any, list[_Entry]]] = {}
        seen_params: dict[str, int] = {}
        for r in reductions:
            owner, attr = _owner(model, r.param)
            p: torch.Tensor | None = owner._parameters.get(attr)
            if p is None or not p.requires_grad:
                continue
            entry = _Entry(r.param, owner, attr, r.source)
            seen_params[r.param] = seen_params.get(r.param, 0) + len(r.axes)
            for axis in r.axes:
                key = axis
                group = r.group if r.group is not None else mesh.get_group(axis)
                if dist.get_world_size(group) == 1:
                    continue
                by_key.setdefault(key, (group, []))[1].append(entry)
        buckets: list[_Bucket] = []
        for key, (group, entries) in by_key.items():
            chunk: list[_Entry] = []
            size = 0
            # Reverse model order: the first gradients of backward fill the first bucket.
            for e in reversed(entries):
                p = e.param()
                nbytes = p.numel() * p.element_size() if p is not None else 0
                if chunk and size + nbytes > BUCKET_BYTES:
                    buckets.append(_Bucket(key, group, chunk))
                    chunk, size = [], 0
                chunk.append(e)
                size += nbytes
            if chunk:
                buckets.append(_Bucket(key, group, chunk))
        for b in buckets:
            b.early_ok = all(seen_params[e.name] == 1 for e in b.entries)
        watched = list({(id(e.owner), e.attr): e for b in buckets for e in b.entries}.values())
        every = (
            [_Entry(n, *_owner(model, n)) for n, _ in model.named_parameters()]
            if mode == "validate"
            else []
        )
        return cls(buckets, mode, watched, every)

    # ------------------------------------------------------------------ wiring
    def attach(self, model: nn.Module, journal: Journal) -> None:
        pre = model.register_forward_pre_hook(lambda _m, _a: self.arm())
        post = model.register_forward_hook(lambda _m, _a, out: self._watch_outputs(out))
        journal.record(pre.remove)
        journal.record(post.remove)
        journal.record(self.remove)

    def remove(self) -> None:
        for h in self._hooks.values():
            h.remove()
        self._hooks = {}
        self._objects = {}

    def _watch_outputs(self, out: Any) -> None:
        """Backward's first gradient reaches a model output: queue the end-of-backward reduction."""
        if not self._armed:
            return
        for t in tensors_in(out):
            if t.requires_grad:
                t.register_hook(self._on_backward_start)

    def _on_backward_start(self, grad: torch.Tensor) -> torch.Tensor:
        self._queue()
        return grad

    def _queue(self) -> None:
        if self._queued or not self._armed:
            return
        self._queued = True
        self._dirty = True
        # Queued from inside a callback, the reduction runs after every callback that was
        # queued during backward (FSDP2's, DDP's), whatever order they were queued in.
        Variable._execution_engine.queue_callback(
            lambda: Variable._execution_engine.queue_callback(self._finish)
        )

    # ------------------------------------------------------------------ one step
    def arm(self) -> None:
        """A forward with gradients starts: remember what is already reduced."""
        if not torch.is_grad_enabled():
            return
        from torch.nn.parallel import DistributedDataParallel

        current = [e.param() for e in self.watched]
        self._exclusive = DistributedDataParallel._get_active_ddp_module() is None and all(
            a is b for a, b in zip(current, self._initial, strict=True)
        )
        self._arm_buckets()
        if self._exclusive:
            for b in self.buckets:
                if not b.early_ok:
                    continue
                for e in b.entries:
                    p = e.param()
                    if p is not None and id(p) not in self._hooks:
                        self._objects[id(p)] = p
                        self._hooks[id(p)] = p.register_post_accumulate_grad_hook(self._arrived)

    def _arm_buckets(self) -> None:
        self._armed = True
        self._queued = False
        self._dirty = False
        for b in self.buckets:
            b.arm()

    def _arrived(self, p: torch.Tensor) -> None:
        if not (self._armed and self._exclusive):
            return
        self._queue()
        for b in self.buckets:
            if not b.early_ok or b.work is not None or not b.waiting:
                continue
            for i, e in enumerate(b.entries):
                if e.param() is p:
                    b.waiting.discard(i)
            if not b.waiting:
                b.start_early()
                self.early += 1

    def _finish(self) -> None:
        if not (self._armed and self._dirty):
            return
        self._armed = False
        if self.mode == "validate":
            self._check_partial_before()
        for b in self.buckets:
            n = b.finish()
            self.reductions += n
            self.by_group[b.key] = self.by_group.get(b.key, 0) + n
        if self.mode == "validate":
            self._check_reduced()
        # Another backward through the same forward (retain_graph) sums only what it adds.
        self._arm_buckets()

    def groups(self) -> list[str]:
        """The process groups this reducer sums over (axis names, expert labels), bucket order."""
        return list(dict.fromkeys(b.key for b in self.buckets))

    def flush(self) -> None:
        """Reduce now whatever a backward left pending (a no-op after the automatic reduction)."""
        self._finish()

    def _check_partial_before(self) -> None:
        """Validate: a reduction the propagation pass derived must meet a partial gradient.

        If DTensor says the gradient is already whole, summing it would multiply it.
        """
        for b in self.buckets:
            for e in b.entries:
                p = e.param()
                g = None if p is None else p.grad
                if (
                    e.source != "propagation"
                    or not isinstance(g, DTensor)
                    or not isinstance(p, DTensor)  # a DTensor gradient's parameter is one
                    or p.device_mesh is not g.device_mesh
                ):
                    continue
                if p is not e.initial:
                    continue  # a wrapper (FSDP2) owns this parameter now and reduces it itself
                dims = list(g.device_mesh.mesh_dim_names or ())
                if b.key in dims and not isinstance(g.placements[dims.index(b.key)], Partial):
                    raise UnreducedGradientError(
                        f"{e.name}: hp's verifier derived a gradient partial on {b.key!r}, but "
                        f"DTensor propagation made it {tuple(g.placements)}; summing it would "
                        f"multiply it by the {b.key} size. This is a bug in hp's verifier: please "
                        "report it."
                    )

    def _check_reduced(self) -> None:
        """Validate: after hp's reductions no parameter's gradient may still be partial."""
        for e in self.every:
            p = e.param()
            g = None if p is None else p.grad
            if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
                raise UnreducedGradientError(
                    f"{e.name}: its gradient is {tuple(g.placements)} after backward: a partial "
                    "sum that no reduction of the plan sums. The plan's layouts say this gradient "
                    "is whole, but the computation splits it; declare the boundary's layouts so "
                    "that hp knows (or report it if the verifier passed this plan)."
                )


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr
