"""``resolve_injection``: a registry name, a dotted path or a ``Target`` → the decorated function.

Above the plugin registries (a name is looked up there, and installed plugins are trusted
import roots), so it is kept apart from the decorators of :mod:`hp_core.injection`, which
every layer below the plugins may import.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hp_core.errors import HpError
from hp_core.injection import (
    DECORATORS,
    InjectionCallError,
    InjectionMeta,
    Target,
    TargetError,
    UntrustedTargetError,
    bind_injection,
    check_config,
    injection_name,
    require_injection_meta,
    user_trusted_packages,
)
from hp_core.plugins import (
    RecordedProvider,
    UnknownRegistryItemError,
    lookup,
    plugin_packages,
)
from hp_core.spec.keywords import close_matches

__all__ = ["ResolvedInjection", "resolve_injection", "trusted_packages"]


def trusted_packages() -> frozenset[str]:
    """Top-level packages a Target may import from: installed hp plugins + user-trusted."""
    return frozenset(user_trusted_packages() | set(plugin_packages()))


_SOURCE_FQN = re.compile(r"plan\[(['\"])(.*?)\1\]")


def _fqn_of(context: Mapping[str, Any], source: str) -> str | None:
    """The FQN of the module an injection is bound for: the applier stamps the inner
    wrapper's target with ``_hp_fqn``; otherwise the ``plan['fqn']`` of the source."""
    target = context.get("target_module")
    stamped = getattr(target, "_hp_fqn", None) if target is not None else None
    if isinstance(stamped, str):
        return stamped
    m = _SOURCE_FQN.search(source)
    return m.group(2) if m else None


def _or_report(provider: str) -> str:
    if provider.startswith(("provider 'user'", "a function passed directly")):
        return " or correct the function"
    return f", or report the failure to {provider}"


@dataclasses.dataclass(frozen=True)
class ResolvedInjection:
    """An injection value resolved to its decorated function, meta and config.

    ``provider`` is the short provider name (a plugin, the user, a package, ``direct``);
    ``provider_description`` says it in words for messages.
    """

    fn: Callable[..., Any]
    meta: InjectionMeta
    config: Mapping[str, Any]
    name: str
    provider: str
    provider_description: str = ""

    def bind(self, context: Mapping[str, Any], *, source: str, fqn: str | None = None) -> Any:
        """Call the function with its context and config.

        A failure inside the function becomes :class:`InjectionCallError` naming it, its
        provider and the module ``fqn`` (by default read from ``source`` /
        ``target_module``), chained to the original. Errors hp itself raises (an
        :class:`~hp_core.HpError`, which names its culprit) and ``KeyboardInterrupt``
        pass through unchanged.
        """
        try:
            return bind_injection(
                self.fn, self.meta, context=context, config=self.config, source=source
            )
        except HpError:
            raise
        except Exception as e:
            module = fqn if fqn is not None else _fqn_of(context, source)
            provider = self.provider_description or self.provider
            what = DECORATORS[self.meta.kind] + (
                " factory" if self.meta.kind == "local_compute" else ""
            )
            where = f" for module {module!r}" if module is not None else ""
            entry = f"the override for {module!r}" if module is not None else "the override"
            raise InjectionCallError(
                f"{source}: the {what} {self.name!r} (from {provider}) failed{where}: "
                f"{type(e).__name__}: {e}\n"
                f"Fix: if its config is wrong, correct it in {entry}; if the function does not fit "
                "this "
                f"module, choose another one there{_or_report(provider)}. The original exception "
                "is "
                "chained below.",
                name=self.name,
                provider=provider,
                fqn=module,
                kind=self.meta.kind,
            ) from e


_REGISTRY_KIND = {"local_compute": "compute_factory", "inner_wrapper": "inner_wrapper"}


def _import_path(path: str, *, source: str, trusted: Iterable[str] | None) -> Any:
    if ":" in path:
        mod_name, _, attr = path.partition(":")
    else:
        mod_name, _, attr = path.rpartition(".")
    top = mod_name.split(".", 1)[0]
    allowed = frozenset(trusted) if trusted is not None else trusted_packages()
    if top not in allowed:
        raise UntrustedTargetError(
            f"{source}: refusing to import {path!r}: its package {top!r} is neither an installed "
            f"hp plugin nor trusted. A plan file must not import arbitrary code. If you trust it, "
            f"call hp_core.trust_packages({top!r}) or set HP_TRUSTED_PACKAGES={top}."
        )
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise TargetError(
            f"{source}: cannot import module {mod_name!r} for {path!r}: {e}"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        names = [n for n in dir(module) if not n.startswith("_")]
        best = close_matches(attr, names, n=1)
        hint = f" Did you mean {best[0]!r}?" if best else ""
        raise TargetError(
            f"{source}: module {mod_name!r} has no attribute {attr!r}.{hint}"
        ) from None


def resolve_injection(
    value: Any,
    kind: str,
    *,
    source: str,
    trusted: Iterable[str] | None = None,
    providers: Mapping[str, RecordedProvider] | None = None,
) -> ResolvedInjection:
    """Resolve a registry name, decorated callable or Target into a ResolvedInjection.

    Config keys of a Target are checked against the factory's explicit parameters here,
    before anything is called or mutated. An unknown registry name raises
    :class:`~hp_core.plugins.UnknownRegistryItemError` prefixed with ``source``;
    ``providers`` (a plan's :attr:`~hp_core.ShardingPlan.providers`) lets its message name
    the distribution the plan was made with.
    """
    if kind not in DECORATORS:
        raise ValueError(f"unknown injection kind {kind!r}; expected one of {sorted(DECORATORS)}")
    config: Mapping[str, Any] = {}
    if isinstance(value, Target):
        ref: Any = value.target
        config = value.config
    else:
        ref = value
    provider = "direct"
    described = ""
    if isinstance(ref, str):
        name = ref
        if "." in ref or ":" in ref:
            fn = _import_path(ref, source=source, trusted=trusted)
            provider = ref.split(".", 1)[0].split(":", 1)[0]
            described = f"package {provider!r} (imported from {ref!r})"
        else:
            registry = _REGISTRY_KIND[kind]
            recorded = (providers or {}).get(f"{registry}.{ref}")
            try:
                item = lookup(registry, ref, recorded=recorded)
            except UnknownRegistryItemError as e:
                raise type(e)(f"{source}: {e.message}", kind=e.kind, name=e.name) from None
            fn = item.value
            provider = item.provider
            described = item.describe_provider()
    elif callable(ref):
        fn = ref
        name = injection_name(ref)
        described = (
            f"a function passed directly (module {getattr(ref, '__module__', None) or '?'!s})"
        )
    else:
        raise TargetError(
            f"{source}: expected a registry name, a {DECORATORS[kind]} function or a Target, got "
            f"{ref!r}."
        )
    meta = require_injection_meta(fn, kind, source=source)
    check_config(fn, meta, config, source=source)
    return ResolvedInjection(
        fn=fn,
        meta=meta,
        config=dict(config),
        name=name,
        provider=provider,
        provider_description=described,
    )
