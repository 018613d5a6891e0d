"""The core's own plugin (name ``builtin``, distribution ``hp-core``).

It registers the default parameter-role rules and boundary templates through the same
hook third-party plugins use, so the planner sees one registry with provenance for
every rule and template.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hp_core.hookspecs import hookimpl


@hookimpl
def hp_register_templates(register: Callable[[Any], None]) -> None:
    """Register the default role rules (in precedence order) and boundary templates."""
    from hp_core.planner.templates.builtin import DEFAULT_BOUNDARY_TEMPLATES
    from hp_core.planner.templates.roles import DEFAULT_ROLE_RULES

    for rule in DEFAULT_ROLE_RULES:
        register(rule)
    for template in DEFAULT_BOUNDARY_TEMPLATES:
        register(template)
