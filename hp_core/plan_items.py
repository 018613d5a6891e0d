"""Plan-time check that every registry item a plan names is installed (``hp plan``/``hp freeze``).

A plan names registry items by name: ``inner_wrapper`` (an inner wrapper) and
``local_compute_fn`` (a compute factory), either as a plain string or as the target of
a ``Target``. ``hp_core.apply`` resolves them in its preflight with
:func:`hp_core.injection.resolve_injection`; this module runs that same resolution on
the plan right after planning, so a name no installed plugin provides is refused with
the message ``apply`` would give, before anything is written or launched. Dotted import
paths (``pkg.module.attr``) are not registry items and are left to ``apply``.

This is the one finder of missing registry items: ``hp plan`` / ``hp freeze`` use it, and
so does :func:`hp_core.artifact.signed.missing_registry_items` (``read_artifact``,
``hp check``), with the table below. It sits above the plugin layer and the injection
resolution it calls; the table is derived from the registry kinds' rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from hp_core.injection import Target
from hp_core.plugins import REGISTRY_KINDS, UnknownRegistryItemError
from hp_core.resolve import resolve_injection

__all__ = [
    "INJECTION_FIELDS",
    "MissingPlanItem",
    "is_import_path",
    "missing_plan_items",
    "named_injections",
]

#: Injection field of a spec → (the ``resolve_injection`` kind preflight resolves it as,
#: the registry a plain name there refers to).
INJECTION_FIELDS: Mapping[str, tuple[str, str]] = {
    spec.plan_field: (spec.injection, spec.kind.value)
    for spec in REGISTRY_KINDS
    if spec.plan_field is not None and spec.injection is not None
}


def is_import_path(name: str) -> bool:
    """``pkg.module.attr`` or ``pkg.module:attr``: imported by ``apply``, not a registry name."""
    return "." in name or ":" in name


def named_injections(plan: Any) -> Iterator[tuple[str, str, str]]:
    """``(fqn, field, name)`` for every injection written as a string (a registry name or an
    import path; a ``Target``'s target included), in plan order. Imports nothing."""
    for fqn, spec in plan.items():
        for field in INJECTION_FIELDS:
            value = getattr(spec, field, None)
            ref = value.target if isinstance(value, Target) else value
            if isinstance(ref, str):
                yield fqn, field, ref


@dataclasses.dataclass
class MissingPlanItem:
    """A registry name the plan uses that no loaded plugin (or user registration) provides."""

    field: str
    name: str
    #: The boundaries naming it, in plan order.
    modules: list[str]
    #: What ``resolve_injection`` (hence ``apply``) raises for it.
    error: UnknownRegistryItemError

    @property
    def where(self) -> str:
        """``plan['fqn'].field``, plus how many other modules name the same item."""
        first = f"plan[{self.modules[0]!r}].{self.field}"
        rest = len(self.modules) - 1
        return first if not rest else f"{first} (and {rest} more module{'s' if rest > 1 else ''})"

    def one_line(self) -> str:
        """``plan['fqn'].field: UnknownRegistryItemError: <apply's message, lines joined>``."""
        message = " ".join(line.strip() for line in str(self.error).splitlines() if line.strip())
        return f"{self.where}: {type(self.error).__name__}: {message}"


def missing_plan_items(plan: Any) -> list[MissingPlanItem]:
    """Every distinct registry name in ``plan``'s specs that does not resolve.

    Uses :func:`hp_core.injection.resolve_injection`, so a missing name gets exactly the
    :class:`UnknownRegistryItemError` (closest name, providing distribution, ``pip
    install`` hint) that ``hp_core.apply`` raises. Imports nothing.
    """
    found: dict[tuple[str, str], MissingPlanItem] = {}
    resolved: set[tuple[str, str]] = set()
    for fqn, field, ref in named_injections(plan):
        if is_import_path(ref):
            continue  # not a registry name
        key = (field, ref)
        if key in resolved:
            continue
        if key in found:
            found[key].modules.append(fqn)
            continue
        try:
            # The name alone: a Target's config is checked by apply, against the item.
            resolve_injection(ref, INJECTION_FIELDS[field][0], source=f"plan[{fqn!r}].{field}")
            resolved.add(key)
        except UnknownRegistryItemError as e:
            found[key] = MissingPlanItem(field, ref, [fqn], e)
    return list(found.values())
