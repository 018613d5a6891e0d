"""The core's own plugin (name ``builtin``, distribution ``hp-core``).

It registers the default parameter-role rules and boundary templates through the same
hook third-party plugins use, so the planner sees one registry with provenance for
every rule and template. The plugin layer loads it by module name
(``hp_core.plugins.BUILTIN_PLUGIN_MODULE``), like an entry point, so the plugin
layer imports nothing from the planner above it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hp_core.hookspecs import PLUGIN_API_VERSION, hookimpl
from hp_core.planner.sharded_norm import SHARDED_QK_NORM, norm_collectives, sharded_qk_norm
from hp_core.planner.templates.builtin import DEFAULT_BOUNDARY_TEMPLATES
from hp_core.planner.templates.linear import SINGLE_MODULE_TEMPLATES
from hp_core.planner.templates.roles import DEFAULT_ROLE_RULES

__all__ = ["HP_PLUGIN_API", "hp_register_inner_wrappers", "hp_register_templates"]

#: The plugin contract this plugin is built for (checked like any plugin's).
HP_PLUGIN_API = PLUGIN_API_VERSION


@hookimpl
def hp_register_templates(register: Callable[[Any], None]) -> None:
    """Register the default role rules (in precedence order) and boundary templates."""
    for rule in DEFAULT_ROLE_RULES:
        register(rule)
    for template in (*DEFAULT_BOUNDARY_TEMPLATES, *SINGLE_MODULE_TEMPLATES):
        register(template)


@hookimpl
def hp_register_inner_wrappers(register: Callable[..., None]) -> None:
    """Register ``sharded_qk_norm``: full-width q/k norms on a tp-sharded projection."""
    register(SHARDED_QK_NORM, sharded_qk_norm, region_dispatch=True, collectives=norm_collectives)
