"""ParallelContext: one computation of sizes, active axes, sequence parallelism and sub-meshes."""

from __future__ import annotations

import dataclasses

import pytest

from hp_core import MeshSpec, ParallelContext
from hp_core.plans import ShardingPlan


class FakeDeviceMesh:
    """Enough of a DeviceMesh for the context: names, shape, indexing, get_group."""

    def __init__(self, names, shape):
        self.mesh_dim_names, self.shape = tuple(names), tuple(shape)

    def __getitem__(self, axis):
        return f"<{axis}>"

    def get_group(self, axis=None):
        return None


def test_from_spec_sizes_only():
    ctx = ParallelContext.from_spec(
        MeshSpec.parse("dp=2,tp=2,cp=1"), sequence_parallel=True, ep_size=2
    )
    assert ctx.active_axes == ("dp", "tp", "ep")
    assert ctx.guard_axes == {"tp", "ep", "sp"} and ctx.sequence_parallel
    assert (ctx.mesh, ctx.tp_mesh, ctx.cp_mesh, ctx.ep_mesh) == (None, None, None, None)
    assert (ctx.size("tp"), ctx.size("cp"), ctx.size("zz")) == (2, 1, 1)
    assert repr(ctx) == "<ParallelContext dp=2,tp=2,cp=1 sp ep=2>"
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.ep_size = 3  # frozen


def test_sequence_parallel_needs_an_active_tp():
    assert not ParallelContext.from_spec(
        MeshSpec.parse("tp=1,cp=2"), sequence_parallel=True
    ).sequence_parallel
    assert ParallelContext.from_spec(
        MeshSpec.parse("tp=1,cp=2"), sequence_parallel=True
    ).guard_axes == {"cp"}


def test_from_mesh_sub_meshes_of_active_axes_only():
    plan = ShardingPlan(
        modules={}, mesh_axis_names=("dp", "tp", "cp"), mesh_shape=(2, 2, 1), ep_size=1
    )
    ctx = ParallelContext.from_mesh(FakeDeviceMesh(("dp", "tp", "cp"), (2, 2, 1)), plan)
    assert (ctx.tp_mesh, ctx.cp_mesh, ctx.ep_mesh) == ("<tp>", None, None)
    assert ctx.sequence_parallel == plan.sequence_parallel
    assert ctx.with_ep_mesh("<expert>").ep_mesh == "<expert>" and ctx.ep_mesh is None
    assert "on a DeviceMesh" in repr(ctx)


def test_from_plan_unknown_sizes_count_as_active():
    plan = ShardingPlan(modules={}, mesh_axis_names=("cp", "tp"), mesh_shape=None)
    ctx = ParallelContext.from_plan(plan, FakeDeviceMesh(("cp", "tp"), (2, 2)))
    assert ctx.active_axes == ("cp", "tp") and (ctx.cp_mesh, ctx.tp_mesh) == ("<cp>", "<tp>")
    assert ctx.size("cp") == 1  # unknown
