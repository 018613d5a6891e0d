"""The mesh and the inputs the verifier runs the model with (meta tensors, one rank's share)."""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from hp_core.mesh import MeshSpec, is_device_mesh, mesh_axes
from hp_core.plans.model import ShardingPlan
from hp_core.runtime.partial import activations_on, is_data_axis
from hp_core.verifier.errors import UnverifiableError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hp_core.mesh import MeshLike

__all__ = [
    "default_inputs",
    "example_inputs",
    "to_meta_inputs",
    "verification_mesh",
    "whole_inputs",
]


@contextlib.contextmanager
def verification_mesh(
    plan: ShardingPlan, mesh: DeviceMesh | MeshLike | None
) -> Iterator[DeviceMesh]:
    """A DeviceMesh to verify on: the given one, or one over a fake process group."""
    if is_device_mesh(mesh):
        yield mesh
        return
    spec = MeshSpec.from_any(mesh) if mesh is not None else None
    if spec is None:
        if plan.mesh_shape is None:
            raise UnverifiableError(
                "verify(): the plan knows only its axis names; pass the mesh sizes, e.g. "
                "verify(model, plan, 'tp=8')."
            )
        spec = MeshSpec(plan.mesh_axis_names, plan.mesh_shape)
    if dist.is_available() and dist.is_initialized():
        raise UnverifiableError(
            "verify(): a process group is already initialized, so hp cannot start a fake one for "
            f"{spec}; pass the DeviceMesh the plan will run on (verification on it communicates "
            "nothing)."
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(spec.sizes))
    try:
        yield init_device_mesh("cpu", spec.sizes, mesh_dim_names=spec.axis_names)
    finally:
        dist.destroy_process_group()


def _sequence_length(mesh: DeviceMesh) -> tuple[int, int]:
    sizes = dict(zip(mesh_axes(mesh), mesh.shape, strict=True))
    tp, cp = sizes.get("tp", 1), sizes.get("cp", 1)
    return 4 * tp * cp * 2, cp  # a multiple of tp, cp and 2*cp (load-balanced CP)


def default_inputs(model: nn.Module, mesh: DeviceMesh) -> tuple[tuple[Any, ...], dict[str, Any]]:
    total, cp = _sequence_length(mesh)
    ids = torch.empty(
        (2, total // cp), dtype=torch.long, device="meta"
    )  # this rank's share of the sequence
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - nn.Module forwards are introspectable
        params = {}
    if "input_ids" in params:
        kwargs: dict[str, Any] = {"input_ids": ids}
        if "labels" in params:
            kwargs["labels"] = ids
        if "use_cache" in params:
            kwargs["use_cache"] = False
        return (), kwargs
    if any(isinstance(m, nn.Embedding) for m in model.modules()):
        return (ids,), {}
    raise UnverifiableError(
        f"verify(): hp cannot guess what {type(model).__name__}.forward takes; pass one rank's "
        "inputs, e.g. report = hp_core.verify(model, plan, mesh, inputs=((x,), {})), then "
        "apply(..., verify=report)."
    )


def to_meta_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.empty(v.shape, dtype=v.dtype, device="meta")
        if isinstance(v, dict):
            return {k: conv(i) for k, i in v.items()}
        if isinstance(v, list | tuple):
            return type(v)(conv(i) for i in v)
        return v

    if isinstance(inputs, dict):
        return (), conv(inputs)
    if (
        isinstance(inputs, tuple)
        and len(inputs) == 2
        and isinstance(inputs[1], dict)
        and isinstance(inputs[0], tuple | list)
    ):
        return tuple(conv(inputs[0])), conv(inputs[1])
    if isinstance(inputs, tuple | list):
        return tuple(conv(inputs)), {}
    return (conv(inputs),), {}


def _sequence_split(plan: ShardingPlan, mesh: DeviceMesh) -> int:
    """Into how many chunks a rank's inputs split the sequence (dim 1): the product of the
    axes that shard activations everywhere (context parallelism)."""
    sizes = dict(zip(mesh_axes(mesh), (int(n) for n in mesh.shape), strict=True))
    return math.prod(
        n
        for a, n in sizes.items()
        if n > 1 and not is_data_axis(a) and activations_on(plan.modules, a) == "sharded"
    )


def _resized(
    args: tuple[Any, ...], kwargs: dict[str, Any], scale: Callable[[int], int]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def resize(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() >= 2:
            shape = list(v.shape)
            shape[1] = scale(shape[1])
            return torch.empty(shape, dtype=v.dtype, device="meta")
        return v

    return tuple(resize(a) for a in args), {key: resize(v) for key, v in kwargs.items()}


def whole_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], plan: ShardingPlan, mesh: DeviceMesh
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The unsharded model's inputs: a rank's inputs are its chunk of the sequence (dim 1)
    along every axis that shards activations everywhere (context parallelism)."""
    k = _sequence_split(plan, mesh)
    return (args, kwargs) if k == 1 else _resized(args, kwargs, lambda n: n * k)


def example_inputs(
    plan: ShardingPlan, mesh: DeviceMesh
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """One rank's share of the training call the plan records (``plan.example``, the call
    of the whole model), or None when the plan records none."""
    if plan.example is None:
        return None
    args, kwargs = plan.example.meta()
    k = _sequence_split(plan, mesh)
    return (args, kwargs) if k == 1 else _resized(args, kwargs, lambda n: n // k)
