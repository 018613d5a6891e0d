"""The registry kinds are declared once (``REGISTRY_KINDS``); what follows from a row."""

from __future__ import annotations

import inspect

import pytest

import hp_core
import hp_core.plugins as plugins
from hp_core.injection import inner_wrapper, local_compute
from hp_core.plugins import (
    KIND_SPECS,
    REGISTRY_KINDS,
    InvalidRegistrationError,
    PluginRegistry,
    RegistryKind,
    register_plugin,
)

pytestmark = pytest.mark.usefixtures("plugin_env")


@inner_wrapper
def _wrapper(target_module, ctx):
    return None


@local_compute
def _factory(ctx):
    return None


def _comms(sizes, config):
    return []


@pytest.mark.parametrize("spec", REGISTRY_KINDS, ids=lambda s: s.kind.value)
def test_each_row_names_its_registry_view_and_register_function(spec):
    view = getattr(plugins, spec.registry)
    assert isinstance(view, PluginRegistry) and view.kind is spec.kind
    fn = getattr(plugins, spec.register_fn)
    assert fn.__name__ == spec.register_fn
    assert list(inspect.signature(fn).parameters) == list(spec.signature.parameters)
    assert getattr(hp_core, spec.register_fn) is fn  # still exported from hp_core


def test_callbacks_are_derived_from_the_validators():
    assert KIND_SPECS[RegistryKind.INNER_WRAPPER].callback_text() == (
        'register(name, fn, *, needs_cp=False, region_dispatch=None, forward_style="any", '
        "collectives=None)"
    )
    assert KIND_SPECS[RegistryKind.TRAINING_ADAPTER].callback_text() == (
        "register(name, adapter, *, axis)"
    )
    assert KIND_SPECS[RegistryKind.TRAINING_ADAPTER].usage() == (
        "register_training_adapter(name, adapter, axis=...)"
    )
    assert KIND_SPECS[RegistryKind.TEMPLATE].usage() == "register_template(item)"


def test_plan_fields_come_from_the_rows():
    from hp_core.plan_items import INJECTION_FIELDS

    assert dict(INJECTION_FIELDS) == {
        "inner_wrapper": ("inner_wrapper", "inner_wrapper"),
        "local_compute_fn": ("local_compute", "compute_factory"),
    }


def test_collectives_is_stored_on_the_item():
    wrapper = plugins.register_inner_wrapper("kinds_wrapper", _wrapper, collectives=_comms)
    factory = plugins.register_compute_factory("kinds_factory", _factory, collectives=_comms)
    plain = plugins.register_inner_wrapper("kinds_plain", _wrapper)
    assert wrapper.collectives is _comms and factory.collectives is _comms
    assert plain.collectives is None
    assert "collectives" not in wrapper.meta  # meta keeps the static requirements only


def test_collectives_through_a_hook():
    class Plugin:
        HP_PLUGIN_API = 2

        @plugins.hookimpl
        def hp_register_compute_factories(self, register):
            register("kinds_hook_factory", _factory, architectures=(), collectives=_comms)

    register_plugin(Plugin(), name="kinds_hook")
    assert plugins.COMPUTE_FACTORY_REGISTRY["kinds_hook_factory"].collectives is _comms


@pytest.mark.parametrize("fn", ["register_inner_wrapper", "register_compute_factory"])
def test_collectives_must_be_none_or_callable(fn):
    value = _wrapper if fn == "register_inner_wrapper" else _factory
    with pytest.raises(InvalidRegistrationError, match=r"collectives=\[\] is not valid") as e:
        getattr(plugins, fn)("kinds_bad", value, collectives=[])
    assert "Fix: pass the function itself, or leave collectives=None." in str(e.value)
    assert "kinds_bad" not in plugins.INNER_WRAPPER_REGISTRY


def test_bad_arguments_name_the_register_function():
    with pytest.raises(TypeError, match=r"^register_inner_wrapper\(\) .*needs_kp"):
        plugins.register_inner_wrapper("kinds_typo", _wrapper, needs_kp=True)
