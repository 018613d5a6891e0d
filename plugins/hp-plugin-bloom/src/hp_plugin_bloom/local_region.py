"""Run a BLOOM block on this rank's shards, with the residual joining the partial sum once.

``BloomAttention`` and ``BloomMLP`` add the residual stream to their row-parallel output
themselves. Under tensor parallelism that output is a partial sum (each rank's heads or
features; the boundary's exit reduction adds them up), so a residual added on every rank
would be counted ``tp`` times. Here it is added on tp rank 0 only — every other rank adds
``0 * residual``, which keeps it in the autograd graph, so each rank's gradient of the
residual is a partial one, exactly what the core's convention for a whole input of a
sharded region expects (it reduces that gradient over tp).

Production calls a wrapper with local tensors. Validate (``region_dispatch=True``) calls
it with DTensors: it steps down to this rank's local shards with their gradient layouts
declared, runs the same local code, and wraps the outputs by the contract (partial on
tp), so both modes compute the same thing and no implicit redistribution happens.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from hp_core import HpError, ParallelContext, inner_wrapper

__all__ = [
    "RESIDUAL_WRAPPER",
    "BloomTensorParallelError",
    "LocalRegion",
    "bloom_residual_once",
    "tp_position",
]

#: The registry name of :func:`bloom_residual_once`.
RESIDUAL_WRAPPER = "bloom_residual_once"


class BloomTensorParallelError(HpError, ValueError):
    """A BLOOM block whose inputs, shards or mesh do not fit hp-plugin-bloom's tp layout."""


def tp_position(target_module: nn.Module, ctx: ParallelContext) -> tuple[int, int]:
    """(this rank's tp coordinate, the tp size); refuses a mesh with an active cp axis."""
    if ctx.cp_mesh is not None:
        fqn = getattr(target_module, "_hp_fqn", type(target_module).__name__)
        raise BloomTensorParallelError(
            f"{fqn}: hp-plugin-bloom shards BLOOM over tp only, and this mesh has cp="
            f"{ctx.size('cp')}: ALiBi's bias under context parallelism would need each rank's "
            "key positions, which this plugin does not compute. Fix: plan BLOOM without a cp axis."
        )
    tp_mesh = ctx.tp_mesh
    if tp_mesh is None:
        return 0, 1
    return int(tp_mesh.get_local_rank()), int(tp_mesh.size())


def _grad_placement(p: Placement, on_tp: bool) -> Placement:
    """The layout of a local tensor's gradient in the region: a whole tensor feeding only this
    rank's shard of the computation gets a partial gradient on tp; shards stay shards."""
    return Partial() if isinstance(p, Replicate) and on_tp else p


def _grads(placements: tuple[Placement, ...], mesh: Any) -> tuple[Placement, ...]:
    names = list(mesh.mesh_dim_names or ())
    return tuple(_grad_placement(p, n == "tp") for p, n in zip(placements, names, strict=True))


def _owner(module: nn.Module, path: str) -> tuple[nn.Module, str, Any]:
    head, _, name = path.rpartition(".")
    owner = module.get_submodule(head) if head else module
    return owner, name, owner._parameters[name]


@contextlib.contextmanager
def _swapped(module: nn.Module, params: Mapping[str, Any]) -> Iterator[None]:
    saved = {path: _owner(module, path) for path in params}
    for path, value in params.items():
        owner, name, _ = saved[path]
        owner._parameters[name] = value
    try:
        yield
    finally:
        for owner, name, before in saved.values():
            owner._parameters[name] = before


def _same(t: torch.Tensor) -> torch.Tensor:
    # The dispatching region packs saved tensors as DTensors; these stay local shards.
    return t


class LocalRegion:
    """The replacement forward of a BLOOM block: its own forward on local shards.

    Subclasses adapt the arguments in :meth:`local_arguments` and say the layout of each
    output in :attr:`output_placements` (per output: the placement on tp).
    """

    #: tp placement of each output, in order (validate wraps the local results with them).
    output_placements: tuple[Placement, ...] = (Partial(),)

    def __init__(self, module: nn.Module, rank: int, size: int) -> None:
        self.module = module
        self.original = module.forward
        self.rank, self.size = rank, size
        self.fqn = str(getattr(module, "_hp_fqn", type(module).__name__))
        self.__signature__ = inspect.signature(self.original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arguments = dict(self.__signature__.bind(*args, **kwargs).arguments)
        if any(
            isinstance(p, DTensor) and any(isinstance(q, Shard) for q in p.placements)
            for p in self.module.parameters()
        ):
            return self._validate(arguments)
        return self.run(arguments)

    def local_arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The residual joins the partial sum once: whole on tp rank 0, ``0 *`` elsewhere."""
        residual = arguments.get("residual")
        if self.size > 1 and isinstance(residual, torch.Tensor):
            arguments = {**arguments, "residual": residual * float(self.rank == 0)}
        return arguments

    def run(self, arguments: dict[str, Any]) -> Any:
        """Local tensors: the module's own forward on the adapted arguments."""
        bound = self.__signature__.bind_partial()
        bound.arguments.update(self.local_arguments(arguments))  # extra keywords stay keywords
        return self.original(*bound.args, **bound.kwargs)

    def _validate(self, arguments: dict[str, Any]) -> Any:
        """Validate: the same local computation on this rank's shards, declared both ways."""
        local: dict[str, Any] = {}
        for name, value in arguments.items():
            local[name] = (
                value.to_local(grad_placements=_grads(value.placements, value.device_mesh))
                if isinstance(value, DTensor)
                else value
            )
        params = {
            path: p.to_local(grad_placements=_grads(p.placements, p.device_mesh))
            for path, p in self.module.named_parameters()
            if isinstance(p, DTensor)
        }
        mesh = next(p for p in self.module.parameters() if isinstance(p, DTensor)).device_mesh
        with _swapped(self.module, params), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            out = self.run(local)
        names = list(mesh.mesh_dim_names or ())
        items = list(out) if isinstance(out, tuple) else [out]
        wrapped = [
            DTensor.from_local(
                item, mesh, [tp if n == "tp" else Replicate() for n in names], run_check=False
            )
            for item, tp in zip(items, self.output_placements, strict=True)
        ]
        return tuple(wrapped) if isinstance(out, tuple) else wrapped[0]


@inner_wrapper
def bloom_residual_once(target_module: nn.Module, ctx: ParallelContext) -> Any:
    """Run ``BloomMLP`` on local shards, its residual added to the partial sum once."""
    return LocalRegion(target_module, *tp_position(target_module, ctx))
