"""Templates: how the planner turns a classified module into its boundary contract.

- :mod:`~hp_core.planner.templates.roles`: parameter roles, role rules and
  ``BoundaryTemplate`` (what a plugin registers);
- :mod:`~hp_core.planner.templates.context`: ``TemplateContext``, what a template's
  ``build`` receives;
- :mod:`~hp_core.planner.templates.builtin`: the core's own boundary templates.

This package re-exports the roles module only: structure analysis imports it, and the
context and built-in templates import structure analysis back.
"""

from __future__ import annotations

from hp_core.planner.templates.roles import (
    BOUNDARY_KINDS,
    DEFAULT_ROLE_RULES,
    BoundaryTemplate,
    Role,
    RoleRule,
    TemplateDefinitionError,
    classify_param,
)

__all__ = [
    "BOUNDARY_KINDS",
    "DEFAULT_ROLE_RULES",
    "BoundaryTemplate",
    "Role",
    "RoleRule",
    "TemplateDefinitionError",
    "classify_param",
]
