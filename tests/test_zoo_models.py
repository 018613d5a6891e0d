"""The zoo's hand-written models (tests/zoo) train on one device as their projects do.

One process, no world: each factory builds the same seeded weights on every call (the
equivalence check needs that), its training call gives a finite loss whose backward
reaches every parameter, and the two traps the zoo documents are real: gpt-fast's
in-place kv caches break the second training step, and minGPT's ``mlpf`` lambda makes a
``deepcopy`` train the original's MLP (with :func:`~tests.zoo.mingpt.tiny_copyable` as
the control that copies correctly).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from tests.zoo import gpt_fast, litgpt, mingpt, nanogpt, torchtitan_llama

CASES: list[tuple[str, ModuleType, Callable[[], nn.Module]]] = [
    ("nanogpt", nanogpt, nanogpt.tiny),
    ("gpt_fast", gpt_fast, gpt_fast.tiny),
    ("torchtitan_llama", torchtitan_llama, torchtitan_llama.tiny),
    ("litgpt_llama", litgpt, litgpt.tiny_llama),
    ("litgpt_pythia", litgpt, litgpt.tiny_pythia),
    ("litgpt_phi", litgpt, litgpt.tiny_phi),
    ("mingpt", mingpt, mingpt.tiny),
]


@pytest.mark.parametrize(("name", "mod", "factory"), CASES, ids=[c[0] for c in CASES])
def test_seeded_and_every_parameter_trains(
    name: str, mod: ModuleType, factory: Callable[[], nn.Module]
) -> None:
    a, b = factory(), factory()
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), f"{name}: {n} differs between two builds"
    batch: dict[str, Any] = mod.batch(0)
    assert not torch.equal(batch["idx" if "idx" in batch else "tokens"], _ids(mod.batch(1)))
    loss = mod.loss(a, batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    no_grad = [n for n, p in a.named_parameters() if p.grad is None or not p.grad.any()]
    assert not no_grad, f"{name}: no gradient reached {no_grad}"


def _ids(batch: dict[str, Any]) -> torch.Tensor:
    return batch["idx"] if "idx" in batch else batch["tokens"]


def test_nanogpt_without_targets_computes_the_last_position_only() -> None:
    model = nanogpt.tiny()
    batch = nanogpt.batch(0)
    logits, loss = model(batch["idx"])
    assert loss is None and logits.shape == (2, 1, nanogpt.VOCAB)
    full, _ = model(**batch)
    assert full.shape == (2, nanogpt.SEQ, nanogpt.VOCAB)
    torch.testing.assert_close(full[:, -1:], logits)


def test_gpt_fast_needs_input_pos_and_its_kv_caches_do_not_train() -> None:
    model = gpt_fast.tiny()
    assert all(layer.attention.kv_cache is None for layer in model.layers)
    # Without input_pos, freqs_cis[None] is the whole block_size table: rope cannot view it.
    with pytest.raises(RuntimeError, match="is invalid for input of size"):
        model(gpt_fast.batch(0)["idx"])
    assert gpt_fast.cached_training_fails().startswith(
        "Trying to backward through the graph a second time"
    )
    # Negative control: without caches two steps train.
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(2):
        opt.zero_grad()
        gpt_fast.loss(model, gpt_fast.batch(step)).backward()
        opt.step()


def test_mingpt_lambda_makes_a_deepcopy_train_the_original_mlp() -> None:
    for factory, copies_its_mlp in ((mingpt.tiny, False), (mingpt.tiny_copyable, True)):
        original = factory()
        clone = copy.deepcopy(original)
        mingpt.loss(clone, mingpt.batch(0)).backward()
        own = clone.transformer.h[0].mlp.c_fc.weight.grad
        theirs = original.transformer.h[0].mlp.c_fc.weight.grad
        assert (own is not None) is copies_its_mlp, factory.__name__
        assert (theirs is None) is copies_its_mlp, factory.__name__
