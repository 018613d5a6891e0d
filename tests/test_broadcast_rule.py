"""hp's broadcast rule inside dispatching regions (hp_core/runtime/broadcast.py), op by op.

On a fake process group of 2 (rank 0's view, no communication): a replicated value
expanded along a sharded dimension joins a ``copy_``/``cat`` as this rank's chunk, and its
gradient comes out ``Partial`` (the sum over this rank's heads); empty and zero buffers
that keep the sharded dimension follow the shards. Everything else is left to DTensor.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from hp_core.runtime.broadcast import BroadcastToShards, _broadcast_chunk, _sharded_new


@pytest.fixture
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def _heads(mesh, requires_grad=False):
    full = torch.arange(2 * 4 * 3 * 5, dtype=torch.float32).reshape(2, 4, 3, 5)
    return full, distribute_tensor(full, mesh, [Shard(1)]).requires_grad_(requires_grad)


def test_a_shared_rope_key_is_copied_as_this_ranks_chunk_and_its_gradient_is_partial(mesh):
    _, heads = _heads(mesh)
    shared = torch.randn(2, 1, 3, 2)
    k = DTensor.from_local(shared.clone(), mesh, [Replicate()]).requires_grad_(True)
    with BroadcastToShards():
        buf = heads.new_empty(2, 4, 3, 7)  # a different last dim: DTensor alone replicates it
        buf[..., :5].copy_(heads)
        buf[..., 5:].copy_(k.expand(-1, 4, -1, -1))
    assert buf.placements == (Shard(1),)
    assert buf.to_local().shape == (2, 2, 3, 7)
    assert torch.equal(buf.to_local()[..., 5:], shared.expand(-1, 2, -1, -1))
    # the heads downstream are sharded (as attention's are), so the key's gradient is too
    w = distribute_tensor(torch.ones(2, 4, 3, 7), mesh, [Shard(1)])
    with BroadcastToShards():
        (grad,) = torch.autograd.grad((buf * w).sum(), [k])  # raw, as the verifier reads it
    assert grad.placements == (Partial(),)
    assert torch.equal(grad.to_local(), torch.full((2, 1, 3, 2), 2.0))  # this rank's 2 heads


def test_cat_takes_a_broadcast_piece_as_its_chunk_and_new_zeros_follows_the_shards(mesh):
    _, heads = _heads(mesh)
    shared = DTensor.from_local(torch.ones(2, 1, 3, 1), mesh, [Replicate()])
    with BroadcastToShards():
        out = torch.cat([heads, shared.expand(-1, 4, -1, -1)], dim=-1)
        zeros = heads.new_zeros(2, 4, 3, 9)
    assert out.placements == (Shard(1),) and out.to_local().shape == (2, 2, 3, 6)
    assert zeros.placements == (Shard(1),) and zeros.to_local().shape == (2, 2, 3, 9)
    assert zeros.stride() == (108, 27, 9, 1) and not zeros.to_local().any()


def test_everything_else_is_left_to_dtensor(mesh):
    full, heads = _heads(mesh)
    whole = distribute_tensor(full.clone(), mesh, [Replicate()])  # not a broadcast: real data
    with BroadcastToShards():
        other = heads.new_empty(2, 8, 3, 5)  # the sharded dim changes size: replicated
        kept = torch.cat([heads, whole], dim=-1)  # DTensor's own choice
        ones = heads.new_ones(2, 4, 3, 5)  # initialised by value other than 0: DTensor's rule
        on_cat_dim = torch.cat([heads, heads], dim=1)
        plain = torch.empty(3).copy_(torch.ones(3))
    assert other.placements == (Replicate(),)
    assert kept.shape == (2, 4, 3, 10)
    assert ones.placements == (Shard(1),)  # same shape: DTensor itself follows the input
    assert on_cat_dim.shape == (2, 8, 3, 5)
    assert torch.equal(plain, torch.ones(3))


def test_the_chunk_rule_declines_what_is_not_a_broadcast_along_the_shards(mesh):
    _, heads = _heads(mesh)
    one = torch.ones(2, 1, 3, 5)
    broad = DTensor.from_local(one, mesh, [Replicate()]).expand(-1, 4, -1, -1)
    assert _broadcast_chunk(broad, heads).placements == (Shard(1),)
    assert _broadcast_chunk(broad[0], heads) is None  # other rank
    assert _broadcast_chunk(broad, heads, skip_dim=1) is None  # sharded on the cat dim
    assert _broadcast_chunk(heads, heads) is None  # already sharded
    real = distribute_tensor(torch.ones(2, 4, 3, 5), mesh, [Replicate()])
    assert _broadcast_chunk(real, heads) is None  # real data, not stride 0
    whole = distribute_tensor(torch.ones(2, 4, 3, 5), mesh, [Replicate()])
    assert _broadcast_chunk(broad, whole) is None  # nothing sharded to follow
    partial = DTensor.from_local(torch.ones(2, 4, 3, 5), mesh, [Partial()])
    assert _sharded_new(torch.ops.aten.new_empty.default, partial, [2, 4, 3, 5], (), {}) is None
    assert _sharded_new(torch.ops.aten.new_empty.default, heads, [2, 4, 3], (), {}) is None
