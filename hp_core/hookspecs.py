"""The hooks an hp plugin can implement (pluggy project ``"hp_core"``).

Every hook is *register-callback* style: the host calls ``hp_register_x(register)``
once per plugin with a ``register`` callback bound to that plugin, so each item
records exactly which plugin (and distribution) provided it. A plugin implements
hooks with :data:`hookimpl`::

    from hp_core.hookspecs import hookimpl

    HP_PLUGIN_API = 2  # the plugin contract this plugin is built for (a literal)

    @hookimpl
    def hp_register_inner_wrappers(register):
        register("my_attention", my_attention, needs_cp=True, region_dispatch=False)

The contract is versioned: :data:`PLUGIN_API_VERSION` numbers these hook specs together
with the injection signatures (version 2: injections take ``fn(module, ctx, **config)``,
a ``ParallelContext``, instead of four mesh parameters). A plugin object declares the
version it was built for as the attribute :data:`PLUGIN_API_ATTRIBUTE`
(``HP_PLUGIN_API = 2``); hp checks it before calling any of the plugin's hooks and
refuses a plugin that declares another version or none.

Items are validated before anything is committed; a plugin whose items are all
valid is committed as a whole, otherwise none of its items are (see
``docs/plugins.md``). Each hook fills one registry kind; the kinds are declared once,
as the rows of ``hp_core.plugins.REGISTRY_KINDS`` (a test checks each hook's
``Callback:`` line below against its row).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

__all__ = [
    "PLUGIN_API_ATTRIBUTE",
    "PLUGIN_API_VERSION",
    "PROJECT_NAME",
    "hookimpl",
    "hookspec",
    "hp_register_compute_factories",
    "hp_register_inner_wrappers",
    "hp_register_router_adapters",
    "hp_register_templates",
    "hp_register_training_adapters",
]

#: pluggy project name; also the entry-point group plugins are discovered in.
PROJECT_NAME = "hp_core"

#: The plugin contract (these hook specs + the injection signatures) this hp-core speaks.
PLUGIN_API_VERSION = 2

#: The plugin-object attribute that declares the contract version a plugin was built for.
PLUGIN_API_ATTRIBUTE = "HP_PLUGIN_API"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def hp_register_templates(register: Callable[[Any], None]) -> None:
    """Register boundary templates and parameter-role rules.

    Signature: ``hp_register_templates(register)``.
    Callback: ``register(item)`` where ``item`` is any object with a ``name: str``
    attribute, e.g. ``hp_core.RoleRule(name, pattern, role, architectures=())``.
    An optional ``architectures`` attribute (tuple of HF architecture class names such
    as ``"Phi3ForCausalLM"``) scopes the item to those models; scoped role rules take
    precedence over the core's defaults. Template names may be namespaced with dots
    (``"phi3.fused_qkv"``).
    """


@hookspec
def hp_register_inner_wrappers(register: Callable[..., None]) -> None:
    """Register inner wrappers (replacement forwards for an inner target, e.g. CP attention).

    Signature: ``hp_register_inner_wrappers(register)``.
    Callback: ``register(name, fn, *, needs_cp=False, region_dispatch=None,
    forward_style="any", collectives=None)`` where ``fn`` is decorated with
    ``@inner_wrapper``; ``needs_cp`` says the wrapper only works with an active ``cp``
    axis; ``region_dispatch`` is the value the boundary must declare (None: no
    requirement, True or False); ``forward_style`` is the call style of the wrapped
    module: ``"any"``, ``"qkv"`` (called as ``(q, k, v, ...)``) or ``"hf"`` (an HF
    attention module that calls SDPA / flex attention internally); ``collectives`` is
    None or ``(sizes, config) -> [Collective]``, the collectives one call issues.
    """


@hookspec
def hp_register_compute_factories(register: Callable[..., None]) -> None:
    """Register local-compute factories (e.g. expert-parallel MoE archetypes).

    Signature: ``hp_register_compute_factories(register)``.
    Callback: ``register(name, factory, *, architectures=(), collectives=None)`` where
    ``factory`` is decorated with ``@local_compute``; ``architectures`` lists HF
    architecture class names (e.g. ``"Qwen2MoeForCausalLM"``) for which this factory is
    the suggested compute (see ``hp_core.plugins.suggest_compute_factory``). Two
    factories may not claim the same architecture. ``collectives`` is None or
    ``(sizes, config) -> [Collective]``, the collectives one call of the compute issues.
    """


@hookspec
def hp_register_router_adapters(register: Callable[[str, Callable[..., Any]], None]) -> None:
    """Register MoE router adapters.

    Signature: ``hp_register_router_adapters(register)``.
    Callback: ``register(name, adapter)`` where ``adapter`` is any callable.
    """


@hookspec
def hp_register_training_adapters(register: Callable[..., None]) -> None:
    """Register training adapters: what a training loop must do for a parallel axis.

    Signature: ``hp_register_training_adapters(register)``.
    Callback: ``register(name, adapter, *, axis)`` where ``adapter`` is an object with
    any of the methods ``prepare_model(model, context)`` (after ``apply``; may return a
    replacement model), ``shard_batch(batch, context) -> batch`` (before the forward) and
    ``after_backward(model, context)`` (after ``backward()``, before the optimizer step);
    ``axis`` is the mesh axis name (``"cp"``, ``"tp"``, ``"ep"``, ...) the adapter serves:
    it is used only when that axis is active in the plan. ``context`` is a
    ``hp_core.training.TrainingContext`` (``mesh``, ``tp_mesh``, ``cp_mesh``, ``ep_mesh``,
    ``plan``). ``hp_core.training.TrainingAdapters.for_plan(plan, mesh)`` selects and
    calls them, so a generic loop (``hp demo``) needs no plugin imports.
    """
