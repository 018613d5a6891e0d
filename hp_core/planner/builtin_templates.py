"""``builtin_template(kind)``: the core's own boundary template of a kind, for plugins to defer to.

A plugin template that only refines what the core derives (one more ``tp_divide_attrs``
entry, another inner wrapper) builds the core's spec first and edits it::

    def attention(ctx):
        spec = hp_core.builtin_template("attention").build(ctx)
        spec.tp_divide_attrs = ["heads"]
        return spec

The template returned is the one the built-in plugin registers, whatever else is
registered: a scoped plugin template that defers to it never calls itself.
"""

from __future__ import annotations

from hp_core.planner.templates.builtin import DEFAULT_BOUNDARY_TEMPLATES
from hp_core.planner.templates.linear import SINGLE_MODULE_TEMPLATES
from hp_core.planner.templates.roles import (
    BOUNDARY_KINDS,
    BoundaryTemplate,
    TemplateDefinitionError,
)

__all__ = ["builtin_template"]

_BY_KIND = {t.kind: t for t in (*DEFAULT_BOUNDARY_TEMPLATES, *SINGLE_MODULE_TEMPLATES)}


def builtin_template(kind: str) -> BoundaryTemplate:
    """The core's template for boundary ``kind`` (one of ``BOUNDARY_KINDS``)."""
    template = _BY_KIND.get(kind) if isinstance(kind, str) else None
    if template is None:
        raise TemplateDefinitionError(
            f"builtin_template({kind!r}): the core has no boundary template of that kind; the "
            f"kinds are {', '.join(BOUNDARY_KINDS)}.\nFix: pass one of those kinds (the kind of "
            "the template you are writing: ctx.block.kind)."
        )
    return template
