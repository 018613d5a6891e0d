"""Which distribution provided each registry item a plan names: recorded when it is written.

A plan names registry items (an inner wrapper, a compute factory) by name. When it is
dumped to YAML or frozen into an artifact, each such name's provider (distribution and
version, from the registry at that time) is written under a top-level ``providers:``
mapping keyed ``<registry kind>.<name>``::

    providers:
      inner_wrapper.sdpa_hf: {distribution: hp-plugin-cp, version: 0.1.0}

and read back into :attr:`ShardingPlan.providers`. It is metadata about where the plan
was made: it is part of neither equality nor the fingerprint, and a plan without it
loads. A machine that lacks the item is then told what to install.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from hp_core.errors import HpError
from hp_core.injection import Target
from hp_core.plugins import REGISTRY_KINDS, PluginRegistry, RecordedProvider, RegistryKind

__all__ = [
    "INJECTION_FIELDS",
    "PROVIDERS_KEY",
    "is_import_path",
    "item_key",
    "named_injections",
    "providers_data",
    "providers_from_data",
    "record_providers",
]

#: The top-level key of a plan document (and artifact meta) that holds the providers.
PROVIDERS_KEY = "providers"

#: Injection field of a spec → (the ``resolve_injection`` kind preflight resolves it as,
#: the registry a plain name there refers to).
INJECTION_FIELDS: Mapping[str, tuple[str, str]] = {
    spec.plan_field: (spec.injection, spec.kind.value)
    for spec in REGISTRY_KINDS
    if spec.plan_field is not None and spec.injection is not None
}

_EXAMPLE = "providers: {inner_wrapper.sdpa_hf: {distribution: hp-plugin-cp, version: 0.1.0}}"


def is_import_path(name: str) -> bool:
    """``pkg.module.attr`` or ``pkg.module:attr``: imported by ``apply``, not a registry name."""
    return "." in name or ":" in name


def item_key(registry: str, name: str) -> str:
    """``inner_wrapper.sdpa_hf``: how :data:`PROVIDERS_KEY` (and ``hp_core.items``) name an item."""
    return f"{registry}.{name}"


def named_injections(plan: Any) -> Iterator[tuple[str, str, str]]:
    """``(fqn, field, name)`` for every injection written as a string (a registry name or an
    import path; a ``Target``'s target included), in plan order. Imports nothing."""
    for fqn, spec in plan.items():
        for field in INJECTION_FIELDS:
            value = getattr(spec, field, None)
            ref = value.target if isinstance(value, Target) else value
            if isinstance(ref, str):
                yield fqn, field, ref


def record_providers(plan: Any) -> dict[str, RecordedProvider]:
    """The provider of every registry name ``plan`` uses: what the plan recorded where it
    was made (a plan read back from YAML or an artifact), else the registry's now. Items
    registered without a distribution (``register_*`` calls) have no provider to record."""
    out: dict[str, RecordedProvider] = {}
    known: Mapping[str, RecordedProvider] = getattr(plan, "providers", None) or {}
    for _fqn, field, name in named_injections(plan):
        if is_import_path(name):
            continue
        registry = INJECTION_FIELDS[field][1]
        key = item_key(registry, name)
        if key in out:
            continue
        if key in known:
            out[key] = known[key]
            continue
        item = PluginRegistry(registry).get(name)
        if item is not None and item.distribution is not None:
            out[key] = RecordedProvider(item.distribution, item.version)
    return dict(sorted(out.items()))


def providers_data(providers: Mapping[str, RecordedProvider]) -> dict[str, dict[str, Any]]:
    """The document form of ``providers`` (plain data, keys sorted)."""
    return {
        key: {"distribution": p.distribution, "version": p.version}
        for key, p in sorted(providers.items())
    }


def _fail(err: type[HpError], path: str, what: str) -> HpError:
    return err(
        f"{path}: {what}. Fix: correct or delete the entry (it only records where the plan was "
        f"made; dump_plan / hp freeze write it). Example:\n{_EXAMPLE}"
    )


def providers_from_data(raw: Any, err: type[HpError]) -> dict[str, RecordedProvider]:
    """:data:`PROVIDERS_KEY`'s value read back, every key and value checked."""
    if not isinstance(raw, Mapping):
        raise _fail(err, PROVIDERS_KEY, f"expected a mapping, got {type(raw).__name__} {raw!r}")
    kinds = [k.value for k in RegistryKind]
    out: dict[str, RecordedProvider] = {}
    for key, value in raw.items():
        path = f"{PROVIDERS_KEY}[{key!r}]"
        kind, _, name = str(key).partition(".")
        if not isinstance(key, str) or kind not in kinds or not name:
            raise _fail(
                err, path, f"expected a key '<registry kind>.<name>' (kinds: {', '.join(kinds)})"
            )
        if not isinstance(value, Mapping) or sorted(value) != ["distribution", "version"]:
            raise _fail(err, path, f"expected {{distribution: ..., version: ...}}, got {value!r}")
        dist, version = value["distribution"], value["version"]
        if not isinstance(dist, str) or not dist.strip():
            raise _fail(err, f"{path}.distribution", f"expected a distribution name, got {dist!r}")
        if version is not None and not isinstance(version, str):
            raise _fail(err, f"{path}.version", f"expected a version string, got {version!r}")
        out[key] = RecordedProvider(dist, version)
    return out
