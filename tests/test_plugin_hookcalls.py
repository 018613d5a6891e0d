"""Hooks go through pluggy: monitors and tracing see the calls, tryfirst/trylast order them."""

from __future__ import annotations

import pytest

from hp_core import Role, RoleRule
from hp_core.hookspecs import hookimpl
from hp_core.plugins import (
    ROUTER_ADAPTER_REGISTRY,
    TEMPLATE_REGISTRY,
    plugin_manager,
    register_plugin,
    reset_plugins,
)

pytestmark = pytest.mark.usefixtures("plugin_env")


class TwoImpls:
    """One plugin implementing ``hp_register_templates`` twice (pluggy's ``specname``)."""

    HP_PLUGIN_API = 2

    @hookimpl(specname="hp_register_templates", trylast=True)
    def a_late(self, register):
        register(RoleRule("order.late", r"late$", Role.ROWWISE))

    @hookimpl(specname="hp_register_templates")
    def b_plain(self, register):
        register(RoleRule("order.plain", r"plain$", Role.ROWWISE))

    @hookimpl(specname="hp_register_templates", tryfirst=True)
    def c_first(self, register):
        register(RoleRule("order.first", r"first$", Role.ROWWISE))


class Routers:
    HP_PLUGIN_API = 2

    @hookimpl
    def hp_register_router_adapters(self, register):
        register("monitored_router", len)


def test_a_hookcall_monitor_sees_each_plugins_calls():
    calls = []
    pm = plugin_manager()
    undo = pm.add_hookcall_monitoring(
        lambda name, impls, kwargs: calls.append(("before", name, [i.plugin_name for i in impls])),
        lambda outcome, name, impls, kwargs: calls.append(("after", name, outcome.exception)),
    )
    try:
        register_plugin(Routers(), name="monitored")
    finally:
        undo()
    assert calls == [
        ("before", "hp_register_router_adapters", ["monitored"]),
        ("after", "hp_register_router_adapters", None),
    ]
    assert ROUTER_ADAPTER_REGISTRY["monitored_router"].provider == "monitored"


def test_pluggy_tracing_sees_the_calls():
    lines = []
    pm = plugin_manager()
    pm.trace.root.setwriter(lines.append)
    undo = pm.enable_tracing()
    try:
        register_plugin(Routers(), name="traced")
    finally:
        undo()
        pm.trace.root.setwriter(None)
    assert any("hp_register_router_adapters" in line for line in lines)


def test_tryfirst_and_trylast_order_one_plugins_implementations():
    info = register_plugin(TwoImpls(), name="ordered")
    assert info.items == 3
    names = [name for name in TEMPLATE_REGISTRY if name.startswith("order.")]
    assert names == ["order.first", "order.plain", "order.late"]
    reset_plugins()
