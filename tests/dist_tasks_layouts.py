"""Rank-side tasks: hp's lowered single-axis collectives against DTensor's own redistribute."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

from hp_core.runtime.layouts import Redistribution

P = {"r": Replicate(), "p": Partial(), "s0": Shard(0), "s1": Shard(1)}


def compare_transition(
    names: tuple[str, str], src: dict[str, str], dst: dict[str, str], grad_partial: tuple[str, ...]
) -> dict[str, Any]:
    """Forward values and input gradients of ``Redistribution.local`` vs the DTensor path."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    s = {a: P[v] for a, v in src.items()}
    d = {a: P[v] for a, v in dst.items()}
    tr = Redistribution(s, d, mesh, grad_partial_axes=grad_partial)
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(7 + rank)  # every rank its own local values
    x = torch.randn(4, 8, 6, generator=g)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1 = tr.local(x1)
    y2 = tr.via_dtensor(x2)
    up = torch.randn(y1.shape, generator=torch.Generator().manual_seed(99 + rank))
    (y1 * up).sum().backward()
    (y2 * up).sum().backward()
    return {
        "lowered": tr._local is not None,
        "identity": tr.identity,
        "fwd": float((y1 - y2).abs().max()),
        "bwd": float((x1.grad - x2.grad).abs().max()),
        "non_tensor_passes": tr.local(None) is None and tr.via_dtensor(None) is None,
    }
