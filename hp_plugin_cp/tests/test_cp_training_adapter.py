"""The ``cp`` training adapter: registered through the hook, selected on a cp plan, delegating
to the helpers."""

from __future__ import annotations

from hp_plugin_cp.plugin import CPTrainingAdapter

from hp_core.plans import ShardingPlan
from hp_core.plugins import TRAINING_ADAPTER_REGISTRY, lookup
from hp_core.training import TrainingAdapters
from hp_plugin_cp import plugin


class FakeMesh:
    mesh_dim_names = ("cp", "tp")

    def __getitem__(self, axis):
        return f"<{axis}>"


def test_registered_by_the_cp_plugin(plugins_env):
    item = lookup("training_adapter", "cp")
    assert isinstance(item.value, CPTrainingAdapter)
    assert (item.provider, item.distribution) == ("cp", "hp-plugin-cp")
    assert dict(item.meta) == {"axis": "cp", "methods": ("prepare_model", "shard_batch")}


def test_selected_only_with_an_active_cp_axis(plugins_env):
    def adapters(shape):
        p = ShardingPlan(modules={}, mesh_axis_names=("cp", "tp"), mesh_shape=shape)
        return TrainingAdapters.for_plan(p, FakeMesh()).names

    assert "cp" in adapters((2, 2))
    assert "cp" not in adapters((1, 2))
    plugins_env.setenv("HP_PLUGINS", "moe")
    from hp_core.plugins import reset_plugins

    reset_plugins()
    assert "cp" not in TRAINING_ADAPTER_REGISTRY


def test_delegates_to_the_cp_helpers(plugins_env):
    calls = []
    plugins_env.setattr(
        plugin, "enable_cp_loss", lambda m, mesh: calls.append(("loss", mesh)) or "wrapped"
    )
    plugins_env.setattr(
        plugin,
        "shard_batch_for_cp",
        lambda b, mesh, load_balanced: calls.append(("shard", mesh, load_balanced)) or {"s": 1},
    )
    p = ShardingPlan(modules={}, mesh_axis_names=("cp",), mesh_shape=(2,))
    adapters = TrainingAdapters(
        {"cp": CPTrainingAdapter(load_balanced=True)},
        TrainingAdapters.for_plan(p, FakeMesh()).context,
    )
    assert adapters.prepare_model("model") == "wrapped"
    assert adapters.shard_batch({"input_ids": 0}) == {"s": 1}
    adapters.after_backward("model")  # nothing left to do: hp sums the cp-partial gradients itself
    assert calls == [("loss", "<cp>"), ("shard", "<cp>", True)]
