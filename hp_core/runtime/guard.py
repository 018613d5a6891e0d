"""The input guard: every rank of a tp/cp group must call the model with the same shapes.

A collective whose ranks pass tensors of different sizes does not raise on gloo — it
aborts the process — and hangs or corrupts memory on other backends. Before the first
collective of each forward, the guard compares a digest of the call's tensor shapes and
dtypes (and, for tensors on the CPU, a checksum of their values: ranks fed different
batches of the same shape are caught too) across each non-data-parallel axis of the mesh,
and raises on every rank of the group when they differ. Data-parallel ranks may differ:
they are never compared.

The comparison is one all-reduce of two integers per axis on a gloo group (the mesh's own
on a CPU mesh, a CPU side group otherwise), so on an accelerator it never waits for the
device.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from hp_core.errors import HpError
from hp_core.mesh import mesh_axes
from hp_core.runtime.journal import Journal
from hp_core.runtime.layouts import InputLayoutError
from hp_core.runtime.nested import tensors_in
from hp_core.runtime.partial import activations_on, is_data_axis
from hp_core.spec.module_spec import ModuleShardingSpec, layout_map

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["InputGuard", "InputMismatchError"]


class InputMismatchError(HpError, ValueError):
    """Ranks that must see the same batch were called with different input shapes or dtypes."""


def _checksum(t: torch.Tensor) -> int | float:
    """An order-sensitive checksum of a CPU tensor's values (cheap next to a forward)."""
    flat = t.detach().reshape(-1)
    if not flat.numel():
        return 0
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
    if flat.is_floating_point() or flat.is_complex():
        return float((flat.double().real * weights).sum())
    return int((flat.long() * torch.arange(1, flat.numel() + 1, dtype=torch.int64)).sum())


def _cpu_groups(mesh: DeviceMesh) -> list[tuple[str, Any]]:
    """``(axis, gloo group of this rank along it)`` for every non-dp axis of size > 1.

    A CPU mesh's own groups are gloo already. Otherwise every rank creates a gloo group for
    every line of the mesh along each axis (``new_group`` is collective), in mesh order.
    """
    names = list(mesh.mesh_dim_names or ())
    out: list[tuple[str, Any]] = []
    me = dist.get_rank()
    for i, (axis, size) in enumerate(zip(names, mesh.shape, strict=True)):
        if int(size) <= 1 or is_data_axis(axis):
            continue
        if mesh.device_type == "cpu":
            out.append((axis, mesh.get_group(axis)))
            continue
        lines = mesh.mesh.movedim(i, -1).reshape(-1, int(size)).tolist()
        mine = None
        for ranks in lines:
            group = dist.new_group(ranks, backend="gloo")
            if me in ranks:
                mine = group
        out.append((axis, mine))
    return out


def _first_sequence_split(
    modules: Mapping[str, ModuleShardingSpec], sizes: Mapping[str, int]
) -> tuple[str, str, int] | None:
    """The first boundary that splits dim 1 of an activation the model received whole.

    That is sequence parallelism: along such an axis the model's inputs are whole (the
    embedding's output is) and a later layout shards dim 1. Context parallelism's axes are
    sharded from the start (the user gives each rank its part), so they are not counted.
    """
    axes = [
        a
        for a in sizes
        if sizes[a] > 1 and not is_data_axis(a) and activations_on(modules, a) == "mixed"
    ]
    for fqn, spec in modules.items():
        if not spec.is_boundary:
            continue
        for name, named in layout_map(spec.in_dst).items():
            src = layout_map(spec.in_src).get(name, {})
            split = [
                a
                for a in axes
                if isinstance(p := named.get(a), Shard)
                and p.dim == 1
                and not isinstance(src.get(a), Shard)
            ]
            if split:
                return (
                    f"{fqn} (input {name!r})",
                    "x".join(f"{a}={sizes[a]}" for a in split),
                    math.prod(sizes[a] for a in split),
                )
    return None


def _code(x: Any) -> int:
    digest = hashlib.blake2b(repr(x).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def _describe(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[str, tuple[int, ...], str]]:
    out: list[tuple[str, tuple[int, ...], str]] = []

    def walk(name: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            out.append((name, tuple(v.shape), str(v.dtype).removeprefix("torch.")))
        elif isinstance(v, dict):
            for k, i in v.items():
                walk(f"{name}.{k}" if name else str(k), i)
        elif isinstance(v, list | tuple):
            for j, i in enumerate(v):
                walk(f"{name}[{j}]", i)

    for i, a in enumerate(args):
        walk(f"arg {i}", a)
    for k, v in kwargs.items():
        walk(k, v)
    return out


class InputGuard:
    """Root forward pre-hook: compare this call's input shapes over each non-dp mesh axis."""

    def __init__(
        self,
        model_name: str,
        mesh: DeviceMesh,
        modules: Mapping[str, ModuleShardingSpec],
        fallback: Any = None,
    ) -> None:
        self.model_name = model_name
        self.fallback = (
            fallback  # a SequenceFallback: inference that cannot split its sequence runs whole
        )
        self.groups = _cpu_groups(mesh)
        # Along an axis where the plan shards activations everywhere (context parallelism),
        # each rank is given its own part of the batch: only shapes must agree there.
        self.same_values = {
            axis: activations_on(modules, axis) != "sharded" for axis, _ in self.groups
        }
        self.split = _first_sequence_split(
            modules, dict(zip(mesh_axes(mesh), mesh.shape, strict=True))
        )
        self.checks = 0

    def attach(self, model: nn.Module, journal: Journal) -> None:
        handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)
        journal.record(handle.remove)

    def _hook(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.check(args, kwargs)

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.fallback is not None:
            self.fallback.active = False
        if not self.groups:
            return
        seen = _describe(args, kwargs)
        tensors = tensors_in((args, kwargs))
        if any(t.is_meta for t in tensors):
            return  # the verifier's meta run: shapes only, nothing to compare
        values = [_checksum(t) for t in tensors if t.device.type == "cpu"]
        shape_code = _code(seen)
        value_code = _code((seen, values))
        for axis, group in self.groups:
            code = value_code if self.same_values[axis] else shape_code
            both = torch.tensor([code, -code], dtype=torch.int64)
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
            self.checks += 1
            if int(both[0]) != -int(both[1]):
                shapes = ", ".join(f"{n} {list(s)} {d}" for n, s, d in seen[:4]) or "no tensors"
                if self.same_values[axis]:
                    raise InputMismatchError(
                        f"{self.model_name}.forward: the ranks of one {axis} group were called "
                        f"with different inputs (this rank: {shapes}). Every rank of a {axis} "
                        "group computes on the same batch — hp splits it itself — so give them "
                        "identical inputs: split data over the data-parallel axis only (e.g. a "
                        "DistributedSampler over mesh['dp'], not over the whole world; a "
                        "Trainer/accelerate that wraps the model in DDP over every rank does "
                        "this)."
                    )
                raise InputMismatchError(
                    f"{self.model_name}.forward: the ranks of one {axis} group were called with "
                    f"inputs of different shapes or dtypes (this rank: {shapes}). Each takes its "
                    f"own part of the same batch along {axis}: give every rank an equal part "
                    "(shard_batch_for_cp pads to a multiple)."
                )
        self._check_sequence(args, kwargs)

    def _check_sequence(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The sequence must divide where the plan splits it: say so before the first collective."""
        if self.split is None:
            return
        where, axes, divisor = self.split
        ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if ids is None and args and isinstance(args[0], torch.Tensor):
            ids = args[0]
        if not isinstance(ids, torch.Tensor) or ids.dim() < 2 or ids.shape[1] % divisor == 0:
            return
        n = ids.shape[1]
        if not torch.is_grad_enabled() and self.fallback is not None:
            self.fallback.engage()  # inference: this forward runs without sequence parallelism
            return
        decode = not torch.is_grad_enabled() and n < divisor
        raise InputLayoutError(
            f"{where}: it splits the sequence over {axes} (sequence parallelism), but this batch "
            f"has {n} positions (input shape {tuple(ids.shape)}). "
            + (
                (
                    "Decoding one token at a time (generate() with a KV cache) cannot be split: "
                    "apply a plan made with sequence_parallel=False for generation."
                )
                if decode
                else (
                    f"Pad the sequence to a multiple of {divisor} (mask the padding: "
                    "attention_mask 0, labels -100)."
                )
            )
        )
