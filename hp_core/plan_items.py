"""Plan-time check that every registry item a plan names is installed (``hp plan``/``hp freeze``).

A plan names registry items by name: ``inner_wrapper`` (an inner wrapper) and
``local_compute_fn`` (a compute factory), either as a plain string or as the target of
a ``Target``. ``hp_core.apply`` resolves them in its preflight with
:func:`hp_core.injection.resolve_injection`; this module runs that same resolution on
the plan right after planning, so a name no installed plugin provides is refused with
the message ``apply`` would give, before anything is written or launched.
:func:`check_plan_items` goes further, as ``hp_core.plan`` does at the end of planning:
every injection (import paths and ``Target`` config keys included) is resolved with
:func:`resolve_planned`, the very function apply's preflight uses.

This is the one finder of missing registry items: ``hp plan`` / ``hp freeze`` use it, and
so does :func:`hp_core.artifact.signed.missing_registry_items` (``read_artifact``,
``hp check``), with the table below. It sits above the plugin layer and the injection
resolution it calls; the table is derived from the registry kinds' rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hp_core.plans.providers import INJECTION_FIELDS, is_import_path, named_injections
from hp_core.plugins import UnknownRegistryItemError
from hp_core.resolve import ResolvedInjection, resolve_injection

__all__ = [
    "INJECTION_FIELDS",
    "MissingPlanItem",
    "check_plan_items",
    "is_import_path",
    "missing_plan_items",
    "named_injections",
    "resolve_planned",
    "resolve_value",
]


def resolve_planned(plan: Any, fqn: str, field: str) -> ResolvedInjection | None:
    """``plan[fqn].field`` resolved as ``hp_core.apply``'s preflight resolves it (None when
    unset): a registry name, an import path or a ``Target`` (its config keys checked).

    The one resolution both apply's preflight and :func:`check_plan_items` run. Calls
    nothing and needs no process group; an import path is imported (from trusted
    packages only), as apply does.
    """
    value = getattr(plan[fqn], field)
    return None if value is None else resolve_value(plan, fqn, field, value)


def resolve_value(plan: Any, fqn: str, field: str, value: Any) -> ResolvedInjection:
    """:func:`resolve_planned` for a value known to be set (``plan[fqn].field``)."""
    return resolve_injection(
        value,
        INJECTION_FIELDS[field][0],
        source=f"plan[{fqn!r}].{field}",
        providers=getattr(plan, "providers", None),
    )


def check_plan_items(plan: Any) -> None:
    """Resolve every injection of ``plan`` (modules in plan order, ``inner_wrapper`` before
    ``local_compute_fn``, as apply does), raising the first error apply would raise for it:
    :class:`~hp_core.plugins.UnknownRegistryItemError`, a config-key error,
    :class:`~hp_core.injection.UntrustedTargetError`, ..., each naming ``plan['fqn'].field``.
    """
    for fqn in plan:
        for field in INJECTION_FIELDS:
            resolve_planned(plan, fqn, field)


@dataclasses.dataclass
class MissingPlanItem:
    """A registry name the plan uses that no loaded plugin (or user registration) provides."""

    field: str
    name: str
    #: The boundaries naming it, in plan order.
    modules: list[str]
    #: What ``resolve_injection`` (hence ``apply``) raises for it.
    error: UnknownRegistryItemError
    #: Its message without the ``plan['fqn'].field: `` prefix (``where`` says that).
    message: str = ""

    @property
    def where(self) -> str:
        """``plan['fqn'].field``, plus how many other modules name the same item."""
        first = f"plan[{self.modules[0]!r}].{self.field}"
        rest = len(self.modules) - 1
        return first if not rest else f"{first} (and {rest} more module{'s' if rest > 1 else ''})"

    def one_line(self) -> str:
        """``plan['fqn'].field: UnknownRegistryItemError: <apply's message, lines joined>``."""
        text = self.message or str(self.error)
        message = " ".join(line.strip() for line in text.splitlines() if line.strip())
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
        source = f"plan[{fqn!r}].{field}"
        try:
            # The name alone: check_plan_items checks a Target's config against the item.
            resolve_injection(
                ref,
                INJECTION_FIELDS[field][0],
                source=source,
                providers=getattr(plan, "providers", None),
            )
            resolved.add(key)
        except UnknownRegistryItemError as e:
            bare = e.message.removeprefix(f"{source}: ")
            found[key] = MissingPlanItem(field, ref, [fqn], e, bare)
    return list(found.values())
