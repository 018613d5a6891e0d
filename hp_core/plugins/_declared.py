"""What installed distributions *declare* they provide: the ``hp_core.items`` metadata.

A plugin distribution lists each item it registers in the entry-point group
:data:`ITEMS_GROUP`, one entry per item: name ``<kind>.<item name>`` (a
:class:`RegistryKind` value; the item name may contain dots), value the module of its
``hp_core`` entry point::

    [project.entry-points."hp_core.items"]
    "inner_wrapper.sdpa_hf" = "hp_plugin_cp.plugin"

The metadata is read with :mod:`importlib.metadata`, never by importing a plugin, so a
missing item's provider can be named even when its plugin is disabled or fails to
import. Each declaration is joined with the current plugin report to say whether (and
why not) its plugin is loaded. A plan made elsewhere records its items' providers
(:class:`RecordedProvider`) for the case where no installed distribution declares one.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as importlib_metadata

from hp_core.plugins._config import ENTRY_POINT_GROUP
from hp_core.plugins._items import PluginInfo, RegistryKind
from hp_core.plugins._manager import current_state

__all__ = [
    "ITEMS_GROUP",
    "DeclaredItem",
    "RecordedProvider",
    "declared_items",
    "declared_problems",
    "declared_providers",
]

#: The entry-point group in which a distribution declares the items it provides.
ITEMS_GROUP = f"{ENTRY_POINT_GROUP}.items"


@dataclasses.dataclass(frozen=True)
class RecordedProvider:
    """The distribution (and version) that provided a registry item when a plan was made."""

    distribution: str
    version: str | None = None

    def requirement(self) -> str:
        """``dist==version`` (or just ``dist``), what ``pip install`` takes."""
        return f"{self.distribution}=={self.version}" if self.version else self.distribution


@dataclasses.dataclass(frozen=True)
class DeclaredItem:
    """One ``hp_core.items`` declaration of an installed distribution.

    ``entry_point`` is the name of the distribution's ``hp_core`` entry point whose module
    is ``module`` (None when it has none). ``status`` is that plugin's row in the current
    plugin report (``loaded``, ``failed``, ``disabled``), or ``no entry point`` / ``not
    found`` when the report has no row for it; ``reason`` says why it is not loaded.
    """

    kind: RegistryKind
    name: str
    distribution: str
    version: str | None
    module: str
    entry_point: str | None
    status: str
    reason: str | None = None

    @property
    def loaded(self) -> bool:
        """Whether the declaring plugin is loaded now."""
        return self.status == "loaded"

    def describe(self) -> str:
        """``hp-plugin-cp 0.1.0 (entry point 'cp = hp_plugin_cp.plugin')``."""
        version = f" {self.version}" if self.version else ""
        ep = (
            f"entry point '{self.entry_point} = {self.module}'"
            if self.entry_point is not None
            else f"no {ENTRY_POINT_GROUP} entry point for module {self.module!r}"
        )
        return f"{self.distribution}{version} ({ep})"


def _dist(ep: importlib_metadata.EntryPoint) -> tuple[str, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "?", None
    return dist.metadata["Name"] or "?", dist.version


def _plugin_eps() -> dict[tuple[str, str], str]:
    """(distribution, module) → the ``hp_core`` entry-point name."""
    out: dict[tuple[str, str], str] = {}
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        out.setdefault((_dist(ep)[0], ep.value.split(":", 1)[0]), ep.name)
    return out


def _status(dist: str, entry_point: str | None, report: list[PluginInfo]) -> tuple[str, str | None]:
    if entry_point is None:
        return "no entry point", (
            f"the distribution declares the item but has no {ENTRY_POINT_GROUP} entry point "
            "for that module"
        )
    row = next((p for p in report if p.name == entry_point and p.distribution == dist), None)
    if row is None:
        taken = next((p for p in report if p.name == entry_point), None)
        why = f", which {taken.describe()} uses" if taken is not None else ""
        return "not found", f"no plugin named {entry_point!r} from {dist} was loaded{why}"
    if row.status == "failed":
        return "failed", f"it failed to load: {row.error}"
    if row.status == "disabled":
        return "disabled", f"it is disabled ({row.note})"
    return row.status, None


def _scan() -> tuple[list[DeclaredItem], list[str]]:
    items: list[DeclaredItem] = []
    problems: list[str] = []
    eps = importlib_metadata.entry_points(group=ITEMS_GROUP)
    if not eps:
        return items, problems
    plugins = _plugin_eps()
    report = current_state(strict=False).report
    kinds = [k.value for k in RegistryKind]
    for ep in sorted(eps, key=lambda e: (_dist(e)[0], e.name)):
        dist, version = _dist(ep)
        kind, _, name = ep.name.partition(".")
        where = f"distribution {dist} declares {ITEMS_GROUP} entry '{ep.name} = {ep.value}'"
        if kind not in kinds or not name.strip() or not ep.value.strip():
            what = (
                f"unknown kind {kind!r} (kinds: {', '.join(kinds)})"
                if kind not in kinds
                else ("an empty item name" if not name.strip() else "an empty module")
            )
            problems.append(
                f"{where}: {what}. Fix: name each entry '<kind>.<item name>' = "
                f"'<module of its {ENTRY_POINT_GROUP} entry point>' in that distribution's "
                "pyproject.toml, and reinstall it."
            )
            continue
        module = ep.value.split(":", 1)[0].strip()
        entry_point = plugins.get((dist, module))
        status, reason = _status(dist, entry_point, report)
        declared = DeclaredItem(
            RegistryKind(kind), name, dist, version, module, entry_point, status, reason
        )
        items.append(declared)
    return items, problems


def declared_items() -> list[DeclaredItem]:
    """Every well-formed ``hp_core.items`` declaration of the installed distributions."""
    return _scan()[0]


def declared_problems() -> list[str]:
    """One message per malformed ``hp_core.items`` entry (unknown kind, empty name or module)."""
    return _scan()[1]


def declared_providers(kind: RegistryKind | str, name: str) -> list[DeclaredItem]:
    """The installed distributions that declare item ``name`` of registry ``kind``.

    Reads installed metadata only (no plugin is imported); each entry carries the
    declaring plugin's status in the current plugin report.
    """
    return [d for d in declared_items() if d.kind == kind and d.name == name]
