"""Vocabulary-parallel pieces: the masked embedding lookup and the cross-entropy loss.

With the vocabulary sharded over tp, each rank holds rows ``[start, end)`` of the
embedding / lm_head weight. The lookup zeroes ids outside the shard (the exit
all-reduce sums the partial rows); it replaces only the module's call to
``F.embedding``, never its forward. The loss works on the local logit slice with three
small all-reduces (max, sum of exponentials, target logit) and no gathered logits.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.overrides import TorchFunctionMode

from hp_core.errors import HpError
from hp_core.mesh import mesh_axes

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "VocabLookupError",
    "VocabParallelCausalLMLoss",
    "VocabParallelLookup",
    "vocab_parallel_cross_entropy",
]


class VocabLookupError(HpError, ValueError):
    """A vocab-parallel embedding whose forward hp cannot make vocab-parallel."""


def _masked_lookup(
    ids: torch.Tensor, rows: torch.Tensor, start: int, padding_idx: int | None
) -> torch.Tensor:
    """This rank's share of ``embedding(ids, full_weight)``: rows ``[start, start + len(rows))``.

    Ids outside the shard look up row 0 and are zeroed, so the sum over the vocabulary
    shards is the full lookup (the boundary's exit all-reduce takes it).
    """
    n = rows.shape[0]
    outside = (ids < start) | (ids >= start + n)
    local_ids = (ids - start).masked_fill(outside, 0)
    local_pad = (
        padding_idx - start
        if padding_idx is not None and start <= padding_idx < start + n
        else None
    )
    out = F.embedding(local_ids, rows, local_pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class _Intercept(TorchFunctionMode):
    """Routes ``F.embedding(ids, weight)`` calls on one parameter to a vocab-parallel lookup."""

    def __init__(
        self, is_target: Callable[[Any], bool], lookup: Callable[..., torch.Tensor]
    ) -> None:
        super().__init__()
        self.is_target = is_target
        self.lookup = lookup
        self.fired = 0

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.embedding:
            bound = _EMBEDDING_SIGNATURE.bind(*args, **kwargs)
            if self.is_target(bound.arguments["weight"]):
                self.fired += 1
                return self.lookup(**bound.arguments)
        return func(*args, **kwargs)


_EMBEDDING_SIGNATURE = inspect.signature(F.embedding)


class VocabParallelLookup:
    """The compute of a vocab-parallel embedding boundary.

    It runs the module's *own* forward (so a subclass keeps what it does around the lookup,
    e.g. Gemma's scaled embedding) and replaces only the lookup of its weight by the
    masked, vocab-parallel one. What the subclass does to the partial lookup must be linear
    for the exit sum to be right; the verifier proves it (DTensor keeps the result partial)
    before anything runs. Production works on local tensors; validate on DTensors.
    """

    def __init__(
        self,
        fqn: str,
        module: nn.Embedding,
        forward: Callable[..., Any],
        mesh: DeviceMesh,
        axis: str,
        mode: str,
    ) -> None:
        self.fqn = fqn
        self.module = module
        self.forward = forward
        self.mesh = mesh
        self.axis = axis
        self.mode = mode
        self.axis_index = list(mesh_axes(mesh)).index(axis)
        self.__signature__ = inspect.signature(forward)

    def _check_options(self, max_norm: Any, scale_grad_by_freq: bool) -> None:
        if max_norm is not None or scale_grad_by_freq:
            raise VocabLookupError(
                f"{self.fqn}: {type(self.module).__name__} looks up with max_norm={max_norm} / "
                f"scale_grad_by_freq={scale_grad_by_freq}, which act on the whole vocabulary and "
                f"cannot run on a vocabulary shard. Keep the embedding whole on {self.axis}:\n"
                f"  - match: {self.fqn!r}\n    params: {{weight: {{{self.axis}: replicate}}}}\n"
                f"    out_src: {{output: {{{self.axis}: replicate}}}}"
            )

    def _local_lookup(
        self,
        input: torch.Tensor,
        weight: torch.Tensor,
        padding_idx: Any = None,
        max_norm: Any = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ) -> torch.Tensor:
        self._check_options(max_norm, scale_grad_by_freq)
        start = self.mesh.get_local_rank(self.axis) * weight.shape[0]
        return _masked_lookup(input, weight, start, padding_idx)

    def _dtensor_lookup(
        self,
        input: Any,
        weight: DTensor,
        padding_idx: Any = None,
        max_norm: Any = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ) -> DTensor:
        """Validate: the same masked lookup on the local shards, re-wrapped as a partial sum.

        The weight's gradient is partial on every axis along which the ids are sharded
        (each rank looks up only its tokens); DTensor cannot see that through local code,
        so the lookup says it.
        """
        self._check_options(max_norm, scale_grad_by_freq)
        ids_placements = (
            tuple(input.placements)
            if isinstance(input, DTensor)
            else (Replicate(),) * weight.device_mesh.ndim
        )
        ids = input.to_local() if isinstance(input, DTensor) else input
        grad_placements = [
            Partial() if isinstance(i, Shard) and isinstance(w, Replicate) else w
            for w, i in zip(weight.placements, ids_placements, strict=True)
        ]
        rows = weight.to_local(grad_placements=grad_placements)
        start = self.mesh.get_local_rank(self.axis) * rows.shape[0]
        # Local code: what its backward saves stays local (the region saves DTensors otherwise).
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            out = _masked_lookup(ids, rows, start, padding_idx)
        placements = [
            Partial() if i == self.axis_index else p for i, p in enumerate(ids_placements)
        ]
        return DTensor.from_local(out, weight.device_mesh, placements, run_check=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        weight = self.module._parameters["weight"]
        lookup = self._dtensor_lookup if isinstance(weight, DTensor) else self._local_lookup
        mode = _Intercept(lambda w: w is self.module._parameters["weight"], lookup)
        with mode:
            out = self.forward(*args, **kwargs)
        if not mode.fired:
            raise VocabLookupError(
                f"{self.fqn}: the forward of {type(self.module).__name__} never called "
                "torch.nn.functional.embedding on its weight, so hp cannot make its lookup "
                f"vocab-parallel (its weight is sharded by vocabulary rows on {self.axis}). Keep "
                "the embedding whole:\n"
                f"  - match: {self.fqn!r}\n    params: {{weight: {{{self.axis}: replicate}}}}\n"
                f"    out_src: {{output: {{{self.axis}: replicate}}}}"
            )
        return out


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, group: ProcessGroup
    ) -> torch.Tensor:
        vocab_local = logits.shape[-1]
        start = dist.get_rank(group) * vocab_local
        logits = logits.float()
        gmax = logits.max(dim=-1).values
        if not logits.is_meta:  # the verifier runs this on meta tensors: shapes only
            dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - gmax.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        valid = target != ignore_index
        in_shard = valid & (target >= start) & (target < start + vocab_local)
        local_t = (target - start).masked_fill(~in_shard, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~in_shard, 0.0)
        both = torch.stack([sum_exp, picked])
        if not both.is_meta:
            dist.all_reduce(both, group=group)
        sum_exp, picked = both[0], both[1]
        loss = (sum_exp.log() - picked).masked_fill(~valid, 0.0)
        ctx.save_for_backward(exp, sum_exp, local_t, in_shard, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        exp, sum_exp, local_t, in_shard, valid = ctx.saved_tensors
        grad = exp / sum_exp.unsqueeze(-1)
        onehot = torch.zeros_like(grad).scatter_(
            -1, local_t.unsqueeze(-1), 1.0
        ) * in_shard.unsqueeze(-1)
        grad = (grad - onehot) * (g * valid).unsqueeze(-1)
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: ProcessGroup, *, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token cross-entropy from this rank's slice of the vocabulary (0 where ignored)."""
    return _VocabParallelCE.apply(logits, target, ignore_index, group)


class VocabParallelCausalLMLoss:
    """Drop-in for transformers' ``ForCausalLMLoss`` on vocab-sharded logits.

    Same semantics: labels are padded and shifted left by one unless ``shift_labels`` is
    given; the mean is over non-ignored tokens, or a sum divided by
    ``num_items_in_batch`` when that is passed.
    """

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None = None,
        vocab_size: int | None = None,
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            if labels is None:  # as F.pad(None) would: HF passes one of the two
                raise TypeError("vocab-parallel loss: pass labels or shift_labels")
            padded = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = padded[..., 1:].contiguous()
        per_token = vocab_parallel_cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            shift_labels.reshape(-1).to(logits.device),
            self.group,
            ignore_index=ignore_index,
        )
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(per_token.device)
            return per_token.sum() / num_items_in_batch
        count = (shift_labels != ignore_index).sum()
        return per_token.sum() / count
