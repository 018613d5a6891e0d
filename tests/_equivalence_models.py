"""Model and batch factories of the equivalence-check tests (importable by the spawned ranks).

Each factory builds the same seeded tiny model on every call; each batch factory gives the
model's keyword arguments for one step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hp_core.testing.external_models import TitanTransformer, build_external, external_batch
from hp_core.testing.families import build_family, family_batch
from tests._toy_models import VOCAB as TOY_VOCAB
from tests._toy_models import list_moe_lm


def llama() -> nn.Module:
    return build_family("llama", seed=0)


def llama_batch(step: int) -> dict[str, Any]:
    ids = family_batch("llama", seed=step)
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def gpt2() -> nn.Module:
    return build_family("gpt2", seed=0)


def gpt2_batch(step: int) -> dict[str, Any]:
    ids = family_batch("gpt2", seed=step)
    return {"input_ids": ids, "labels": ids, "use_cache": False}


class TitanLogits(TitanTransformer):
    """torchtitan's Llama layout returning the logits tensor itself (no output object)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(input_ids).logits


def titan_logits() -> nn.Module:
    model = build_external("torchtitan_llama", seed=0)
    out = TitanLogits()
    out.load_state_dict(model.state_dict())
    return out


def titan_batch(step: int) -> dict[str, Any]:
    return {"input_ids": external_batch(seed=step)}


def next_token_loss(logits: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    ids = batch["input_ids"]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


#: ep=2 for the per-expert ModuleList toy: hp stacks its experts at apply, with
#: hp-plugin-moe's routed-only compute.
LIST_MOE_OVERRIDES = [
    {
        "match": "model.layers.*.block_sparse_moe",
        "when": "ep",
        "local_compute_fn": "routed_only",
        "region_dispatch": False,
    }
]


def list_moe() -> nn.Module:
    """The per-expert ``ModuleList`` MoE toy (``experts.3.w1.weight``), seeded."""
    torch.manual_seed(0)
    return list_moe_lm()


def list_moe_batch(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, TOY_VOCAB, (2, 8), generator=gen)}


def swap_two_experts(model: nn.Module, mode: str) -> None:
    """After apply, in production: each rank's first two stacked experts trade weights
    (rows 0 and 1 of every stacked projection), so tokens reach the wrong expert."""
    if mode != "production":
        return
    moe = model.get_submodule("model.layers.0.block_sparse_moe.experts")
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(p[[1, 0, *range(2, p.shape[0])]])


class _FailingBackward(torch.autograd.Function):
    """The identity forward; its backward raises (a stand-in for a broken custom op)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected backward failure")


def production_forward_fails(model: nn.Module, mode: str) -> None:
    """After apply, in production: the forward raises before it starts."""

    def fail(module: nn.Module, args: Any, kwargs: Any) -> None:
        raise RuntimeError("injected forward failure")

    if mode == "production":
        model.register_forward_pre_hook(fail, with_kwargs=True)


def production_backward_fails(model: nn.Module, mode: str) -> None:
    """After apply, in production: the logits pass through an op whose backward raises."""
    if mode == "production":
        model.register_forward_hook(lambda m, args, out: _FailingBackward.apply(out))


def float_ids(step: int) -> dict[str, Any]:
    """Token ids as floats: the embedding refuses them, so the reference itself fails."""
    batch = llama_batch(step)
    return {**batch, "input_ids": batch["input_ids"].float()}


def no_tensors(step: int) -> dict[str, Any]:
    return {"input_ids": [1, 2, 3]}


NOT_A_FACTORY = 3


def not_a_model() -> object:
    return {"weight": torch.zeros(2)}


def llama_per_rank() -> nn.Module:
    """A factory that forgot to fix its seed: other weights on every rank."""
    import torch.distributed as dist

    return build_family("llama", seed=dist.get_rank())


def shift_rank1_logits(model: nn.Module, mode: str) -> None:
    """After apply, on rank 1 only and in production: its logits off by 0.5 (rank 0 exact)."""
    import torch.distributed as dist

    if mode != "production" or dist.get_rank() != 1:
        return

    def shift(module: nn.Module, args: Any, output: Any) -> Any:
        output.logits = output.logits + 0.5
        return output

    model.register_forward_hook(shift)
