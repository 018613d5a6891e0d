"""The input guard's pieces, in-process: digests, checksums, the groups it compares over."""

from __future__ import annotations

import types

import pytest
import torch

from hp_core.runtime import guard as G
from hp_core.runtime.nested import tensors_in


def test_described_inputs_name_every_tensor_however_nested():
    seen = G._describe(
        (torch.ones(2, 3),), {"cache": {"k": [torch.zeros(1, dtype=torch.int32)]}, "flag": True}
    )
    assert seen == [("arg 0", (2, 3), "float32"), ("cache.k[0]", (1,), "int32")]
    assert [t.shape for t in tensors_in(({"a": torch.ones(1)}, [torch.ones(2)]))] == [
        torch.Size([1]),
        torch.Size([2]),
    ]


def test_checksums_see_order_values_and_dtype_kinds():
    ids = torch.tensor([[1, 2], [3, 4]])
    assert G._checksum(ids) != G._checksum(ids.flip(-1))  # order-sensitive
    assert G._checksum(torch.empty(0)) == 0
    assert isinstance(G._checksum(torch.tensor([0.5, 1.5])), float)
    assert G._code(("a", 1)) == G._code(("a", 1)) != G._code(("a", 2))


class _Mesh:
    """The attributes of a DeviceMesh the guard reads, on an accelerator."""

    def __init__(self) -> None:
        self.mesh_dim_names = ("dp", "tp")
        self.shape = (2, 2)
        self.device_type = "cuda"
        self.mesh = torch.arange(4).reshape(2, 2)


def test_on_an_accelerator_the_guard_compares_over_cpu_side_groups(monkeypatch):
    made = []
    monkeypatch.setattr(G.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(
        G.dist, "new_group", lambda ranks, backend: made.append((ranks, backend)) or f"g{ranks}"
    )
    groups = G._cpu_groups(_Mesh())
    # every tp line of the mesh is created, in order, on gloo; dp is never compared
    assert made == [([0, 1], "gloo"), ([2, 3], "gloo")]
    assert groups == [("tp", "g[2, 3]")]


def test_the_sequence_check_reads_ids_embeddings_or_the_first_argument():
    g = types.SimpleNamespace(
        split=("model.layers.0 (input 'hidden_states')", "tp=2", 2), fallback=None
    )
    check = G.InputGuard._check_sequence.__get__(g)
    check((torch.ones(2, 4, dtype=torch.long),), {})  # divisible: fine
    with pytest.raises(G.InputLayoutError, match=r"this batch has 5 positions .* multiple of 2"):
        check((), {"inputs_embeds": torch.ones(2, 5, 8)})
    with torch.no_grad(), pytest.raises(G.InputLayoutError, match=r"generate\(\) with a KV cache"):
        check((torch.ones(1, 1, dtype=torch.long),), {})
    check((), {"other": 3})  # nothing sequence-like: nothing to check
    engaged = []
    g.fallback = types.SimpleNamespace(engage=lambda: engaged.append(True))
    with torch.no_grad():  # inference with a whole-sequence variant: runs it instead of refusing
        check((torch.ones(1, 1, dtype=torch.long),), {})
    assert engaged == [True]
    with pytest.raises(G.InputLayoutError):  # training still refuses
        check((torch.ones(2, 5, dtype=torch.long),), {})
    g.split = None
    check((torch.ones(2, 5, dtype=torch.long),), {})
