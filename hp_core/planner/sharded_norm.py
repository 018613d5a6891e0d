"""A norm over the full width of a tensor-parallel projection, computed on its shard.

OLMo-2, OLMo-3 and OLMoE normalize the whole ``q_proj`` / ``k_proj`` output (heads x
head_dim) with one RMSNorm. When the projection is sharded by heads on ``tp``, each rank
holds a slice of that width: the norm's weight is sharded the same way (``Shard(0)``) and
the one quantity that needs every slice — the mean of the squares over the feature dim —
is averaged over ``tp`` with one small all-reduce (``[batch, seq, 1]`` floats). Its
backward is one all-reduce too: every slice's contribution to that mean's gradient.

The norm runs its *own* forward: a torch-function mode turns the one mean over the
feature dim it takes into the global mean, so eps, the fp32 upcast and the cast back are
exactly the module's. :func:`sharded_qk_norm` is the inner wrapper (registered by the
built-in plugin, ``region_dispatch=True``): it wraps the attention module and swaps the
named norms' forwards for the sharded one during each call. Production runs it on local
shards; validate on DTensors, where each norm steps down to its local shard and back
(no implicit redistribution: the all-reduce is the declared one, :func:`norm_collectives`).
It lives in the planner layer because the built-in plugin that registers it does.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.overrides import TorchFunctionMode

from hp_core.collectives import Collective, all_reduce, copy_to_region
from hp_core.errors import HpError
from hp_core.injection import inner_wrapper

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "SHARDED_QK_NORM",
    "ShardedNormError",
    "norm_collectives",
    "sharded_qk_norm",
]

#: The registry name of :func:`sharded_qk_norm`.
SHARDED_QK_NORM = "sharded_qk_norm"


class ShardedNormError(HpError, RuntimeError):
    """A norm planned as full-width-on-a-shard whose forward is not an RMS-style mean norm."""


class _GlobalFeatureMean(TorchFunctionMode):
    """Inside one norm's forward: its mean over the (sharded) feature dim becomes global.

    ``mean(-1)`` of this rank's ``width / n`` features, all-reduced and divided by ``n``,
    is the mean over all ``width`` features. ``copy_to_region`` then ``all_reduce``: one
    all-reduce forward (the sum of the ranks' means) and one backward (each rank's
    gradient of that sum holds only its own features' share).
    """

    def __init__(self, local_width: int, group: ProcessGroup) -> None:
        super().__init__()
        self.local_width = local_width
        self.group = group
        self.hits = 0

    def _feature_mean(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
        x = args[0] if args else kwargs.get("input")
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self.local_width:
            return False
        dims = list(dim) if isinstance(dim, list | tuple) else [dim]
        return len(dims) == 1 and isinstance(dims[0], int) and dims[0] % x.dim() == x.dim() - 1

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.Tensor.mean, torch.mean) and self._feature_mean(args, kwargs):
            self.hits += 1
            n = dist.get_world_size(self.group)
            out = all_reduce(copy_to_region(out, self.group), self.group) / n
        return out


def _grad_placements(param: DTensor, x: DTensor) -> tuple[Placement, ...]:
    """A norm parameter's gradient layout: its own shards; partial where the tokens are split."""
    out: list[Placement] = []
    for p, xp in zip(param.placements, x.placements, strict=True):
        if isinstance(p, Shard):
            out.append(p)
        elif isinstance(xp, Shard) and xp.dim != x.dim() - 1:
            out.append(Partial())
        else:
            out.append(Replicate())
    return tuple(out)


class _ShardedNorm:
    """The replacement forward of one norm whose input is a feature-dim shard."""

    def __init__(
        self, fqn: str, norm: nn.Module, forward: Callable[..., Any], width: int, group: Any
    ) -> None:
        self.fqn, self.norm, self.forward, self.width, self.group = (
            fqn,
            norm,
            forward,
            width,
            group,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):
            return self._validate(x)
        return self._local(x)

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == self.width:  # the whole width is here (e.g. kept whole on tp)
            return self.forward(x)
        mode = _GlobalFeatureMean(x.shape[-1], self.group)
        with mode:
            y = self.forward(x)
        if mode.hits != 1:
            raise ShardedNormError(
                f"{self.fqn} ({type(self.norm).__name__}): hp planned it as a norm over the full "
                f"width {self.width} of a tp-sharded projection and expects its forward to take "
                f"one mean over the feature dim (an RMSNorm); it took {mode.hits}. "
                "Fix: keep this attention block whole on tp (params {tp: replicate}), or "
                "register a template for this norm's type."
            )
        return y

    def _validate(self, x: DTensor) -> DTensor:
        """Validate: the same local computation on this rank's shards, declared both ways."""
        local: dict[str, torch.Tensor] = {}
        for name, p in self.norm._parameters.items():
            if isinstance(p, DTensor):
                local[name] = p.to_local(grad_placements=_grad_placements(p, x))
        with _swapped(self.norm, local), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            y = self._local(x.to_local(grad_placements=x.placements))
        return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False)


def _same(t: torch.Tensor) -> torch.Tensor:
    # The attention region packs saved tensors as DTensors; these stay local shards.
    return t


@contextlib.contextmanager
def _swapped(module: nn.Module, params: Mapping[str, Any]) -> Iterator[None]:
    saved = {name: module._parameters[name] for name in params}
    module._parameters.update(params)
    try:
        yield
    finally:
        module._parameters.update(saved)


class _WithShardedNorms:
    """The attention module's forward, with its full-width norms sharded for the call."""

    def __init__(
        self, fqn: str, module: nn.Module, norms: Mapping[str, int], group: ProcessGroup
    ) -> None:
        self.original = module.forward
        self.norms = {
            path: (f"{fqn}.{path}", module.get_submodule(path), int(width))
            for path, width in norms.items()
        }
        self.group = group
        self.__signature__ = inspect.signature(self.original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        installed = []
        try:
            for fqn, norm, width in self.norms.values():
                had = "forward" in norm.__dict__
                before = norm.__dict__.get("forward")
                norm.__dict__["forward"] = _ShardedNorm(fqn, norm, norm.forward, width, self.group)
                installed.append((norm, had, before))
            return self.original(*args, **kwargs)
        finally:
            for norm, had, before in reversed(installed):
                if had:
                    norm.__dict__["forward"] = before
                else:
                    del norm.__dict__["forward"]


@inner_wrapper
def sharded_qk_norm(target_module: nn.Module, ctx: Any, norms: dict[str, int] | None = None) -> Any:
    """Run the attention module with each norm of ``norms`` (child path → full width) sharded.

    Each listed norm's input is this rank's feature slice of its projection's output; the
    norm's mean over the feature dim is made global with one all-reduce over ``tp``.
    """
    tp_mesh = getattr(ctx, "tp_mesh", None)
    if tp_mesh is None or not norms:
        return target_module.forward  # no tp axis (or no norm): nothing to reduce
    missing = [p for p in norms if not _has_submodule(target_module, p)]
    if missing:
        fqn = getattr(target_module, "_hp_fqn", type(target_module).__name__)
        raise ShardedNormError(
            f"{fqn}: sharded_qk_norm names norm(s) {missing} that are not submodules of "
            f"{type(target_module).__name__}. Fix: list the norms by their path inside the "
            "attention module, e.g. {q_norm: 256}."
        )
    fqn = str(getattr(target_module, "_hp_fqn", ""))
    return _WithShardedNorms(fqn, target_module, norms, tp_mesh.get_group())


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def norm_collectives(sizes: Mapping[str, int], config: Mapping[str, Any]) -> list[Collective]:
    """Per call: one all-reduce over tp forward and one backward for each sharded norm."""
    if int(sizes.get("tp", 1)) <= 1:
        return []
    out: list[Collective] = []
    for path in config.get("norms") or {}:
        where = f"{path} mean of squares"
        out.append(Collective("all_reduce", "tp", "forward", where))
        out.append(Collective("all_reduce", "tp", "backward", where))
    return out
