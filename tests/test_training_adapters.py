"""Training adapters: the hook, the registry (provenance, validation), selection by active axis,
calls."""

from __future__ import annotations

import pytest

from hp_core import cli, register_training_adapter
from hp_core.context import ParallelContext
from hp_core.plans import ShardingPlan
from hp_core.plugins import (
    TRAINING_ADAPTER_REGISTRY,
    DuplicateRegistrationError,
    InvalidRegistrationError,
    hookimpl,
    register_plugin,
    reset_plugins,
    unregister,
)
from hp_core.training import TrainingAdapters, TrainingContext
from tests._plugin_fakes import clean_plugin_env


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    clean_plugin_env(monkeypatch)
    monkeypatch.setenv("HP_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_plugins()
    yield
    reset_plugins()


class Recorder:
    """Records every call; shard_batch tags the batch with its name."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def prepare_model(self, model, context):
        self.calls.append(("prepare_model", self.name, context.cp_mesh))
        return [*model, self.name]

    def shard_batch(self, batch, context):
        self.calls.append(("shard_batch", self.name))
        return {**batch, "seen": [*batch.get("seen", []), self.name]}

    def after_backward(self, model, context):
        self.calls.append(("after_backward", self.name))


class OnlyAfterBackward:
    def __init__(self, calls):
        self.calls = calls

    def after_backward(self, model, context):
        self.calls.append(("after_backward", "ep"))


class FakeMesh:
    mesh_dim_names = ("cp", "tp")

    def __getitem__(self, axis):
        return f"<{axis} mesh>"


class Applied:
    expert_meshes = {2: "<expert mesh>"}


class Model(list):
    _hp_applied = Applied()


def make_plan(shape=(2, 2), ep_size=1, axes=("cp", "tp")):
    return ShardingPlan(modules={}, mesh_axis_names=axes, mesh_shape=shape, ep_size=ep_size)


def test_active_axes():
    assert ParallelContext.from_plan(make_plan((2, 2))).active_axes == ("cp", "tp")
    assert ParallelContext.from_plan(make_plan((1, 2), ep_size=2)).active_axes == ("tp", "ep")
    assert ParallelContext.from_plan(make_plan(None)).active_axes == (
        "cp",
        "tp",
    )  # sizes unknown: every axis counts


def test_user_registration_provenance_and_hp_plugins(capsys):
    calls = []
    item = register_training_adapter("rec", Recorder("rec", calls), axis="cp")
    assert (item.provider, item.distribution) == ("user", None)
    assert dict(item.meta) == {
        "axis": "cp",
        "methods": ("prepare_model", "shard_batch", "after_backward"),
    }
    assert TRAINING_ADAPTER_REGISTRY["rec"] is item
    with pytest.raises(DuplicateRegistrationError, match="already registered by provider 'user'"):
        register_training_adapter("rec", Recorder("x", calls), axis="cp")
    assert cli.main(["plugins"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if " rec " in x)
    assert "training_adapter" in line and "axis=cp" in line
    unregister("training_adapter", "rec")
    assert "rec" not in TRAINING_ADAPTER_REGISTRY


@pytest.mark.parametrize(
    ("adapter", "axis", "message"),
    [
        (object(), "cp", "has none of the methods prepare_model, shard_batch, after_backward"),
        (type("A", (), {"shard_batch": 3})(), "cp", "attribute 'shard_batch'"),
        (OnlyAfterBackward([]), "c.p", "axis='c.p' is not valid"),
        (OnlyAfterBackward([]), None, "axis=None is not valid"),
    ],
)
def test_invalid_adapters_are_refused(adapter, axis, message):
    with pytest.raises(InvalidRegistrationError, match=message):
        register_training_adapter("bad", adapter, axis=axis)
    assert "bad" not in TRAINING_ADAPTER_REGISTRY


def test_hook_registers_with_the_plugins_provenance():
    calls = []

    class Plugin:
        HP_PLUGIN_API = 2

        @hookimpl
        def hp_register_training_adapters(self, register):
            register("rec", Recorder("rec", calls), axis="cp")

    info = register_plugin(Plugin(), name="fake_training")
    assert info.items == 1
    assert TRAINING_ADAPTER_REGISTRY["rec"].provider == "fake_training"


def test_selection_by_active_axis_and_calls_in_registry_order():
    calls = []
    register_training_adapter("a", Recorder("a", calls), axis="cp")
    register_training_adapter("b", Recorder("b", calls), axis="tp")
    register_training_adapter("e", OnlyAfterBackward(calls), axis="ep")
    register_training_adapter("d", Recorder("d", calls), axis="dp")  # not in the plan

    model = Model()
    adapters = TrainingAdapters.for_plan(make_plan((2, 2), ep_size=2), FakeMesh(), model=model)
    assert adapters.names == ("a", "b", "e")
    assert repr(adapters) == "<TrainingAdapters a, b, e>"
    ctx = adapters.context
    assert isinstance(ctx, TrainingContext)
    assert (ctx.cp_mesh, ctx.tp_mesh, ctx.ep_mesh) == ("<cp mesh>", "<tp mesh>", "<expert mesh>")

    assert adapters.prepare_model(model) == ["a", "b"]
    assert adapters.shard_batch({"input_ids": 1})["seen"] == ["a", "b"]
    adapters.after_backward(model)
    assert calls == [
        ("prepare_model", "a", "<cp mesh>"),
        ("prepare_model", "b", "<cp mesh>"),
        ("shard_batch", "a"),
        ("shard_batch", "b"),
        ("after_backward", "a"),
        ("after_backward", "b"),
        ("after_backward", "ep"),
    ]


def test_inactive_axes_select_nothing_and_calls_are_identities():
    register_training_adapter("a", Recorder("a", []), axis="cp")
    adapters = TrainingAdapters.for_plan(make_plan((1, 2)), object())
    assert adapters.names == () and repr(adapters) == "<TrainingAdapters none>"
    assert adapters.context.cp_mesh is None and adapters.context.ep_mesh is None
    model = object()
    assert adapters.prepare_model(model) is model
    assert adapters.shard_batch({"x": 1}) == {"x": 1}
    adapters.after_backward(model)


def test_explicit_registry():
    class Item:
        meta = {"axis": "tp"}
        value = OnlyAfterBackward([])

    adapters = TrainingAdapters.for_plan(make_plan((1, 2)), FakeMesh(), registry={"x": Item()})
    assert adapters.names == ("x",)
