"""Backward kernels linear in the incoming gradient keep it partial (runtime/gradient_linear.py).

On a fake process group (rank 0's view): with hp's rule each kernel takes a ``Partial``
gradient and a replicated saved value to a ``Partial`` result with no redistribution, inside
DTensor's strict mode (what a validate region runs under); on plain tensors each kernel is
linear in its gradient (the sum of the shares' results is the result of the summed
gradient, softplus's pass-through region included), which is what makes the rule exact. The
negative control: an op that is not linear (``pow``) still needs the all-reduce. End to end,
the matrix's ergo row matches one device with sequence parallelism on through this rule.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._utils import ExplicitRedistributionContext
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from hp_core.runtime.gradient_linear import GRADIENT_LINEAR_OPS, register_partial_gradient_rules

aten = torch.ops.aten
EXTRA = {aten.softplus_backward.default: (1.0, 2.0)}  # beta, threshold


@pytest.fixture
def mesh():
    register_partial_gradient_rules()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def test_registration_is_idempotent():
    register_partial_gradient_rules()
    assert register_partial_gradient_rules() == ()


@pytest.mark.parametrize("op", GRADIENT_LINEAR_OPS, ids=lambda op: op.__name__)
def test_a_partial_gradient_passes_through_without_communication(mesh, op):
    g = DTensor.from_local(torch.randn(4, 8), mesh, [Partial()], run_check=False)
    x = DTensor.from_local(torch.randn(4, 8), mesh, [Replicate()], run_check=False)
    with CommDebugMode() as comm, ExplicitRedistributionContext(strict=True):
        out = op(g, x, *EXTRA.get(op, ()))
    assert out.placements == (Partial(),)
    assert comm.get_total_counts() == 0


@pytest.mark.parametrize("op", GRADIENT_LINEAR_OPS, ids=lambda op: op.__name__)
def test_each_kernel_is_linear_in_its_gradient(op):
    torch.manual_seed(0)
    x = torch.randn(64) * 3  # softplus: both sides of its threshold (2.0)
    g1, g2 = torch.randn(64), torch.randn(64)
    extra = EXTRA.get(op, ())
    torch.testing.assert_close(op(g1 + g2, x, *extra), op(g1, x, *extra) + op(g2, x, *extra))


def test_negative_control_a_nonlinear_op_still_needs_the_sum(mesh):
    g = DTensor.from_local(torch.randn(4, 8), mesh, [Partial()], run_check=False)
    with pytest.raises(RuntimeError, match="Implicit redistribution"):
        with ExplicitRedistributionContext(strict=True):
            aten.pow.Tensor_Scalar(g, 2)
