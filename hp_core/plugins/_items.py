"""Registered items, plugin report rows, and the validation of one registration.

Validation is pure: each ``make_*`` function checks one registration and returns the
``RegisteredItem`` it would become, or raises. Nothing here touches registry state.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Literal

from hp_core.plugins._errors import InvalidRegistrationError

__all__ = [
    "FORWARD_STYLES",
    "TRAINING_ADAPTER_METHODS",
    "USER_PROVIDER",
    "PluginInfo",
    "PluginStatus",
    "Provider",
    "RegisteredItem",
    "RegistryKind",
]

PluginStatus = Literal["loaded", "failed", "disabled", "builtin"]

FORWARD_STYLES: tuple[str, ...] = ("any", "qkv", "hf")

#: Provider name of items registered programmatically with ``register_*``.
USER_PROVIDER = "user"

# Names that can appear as ``_target_`` in a plan must not contain dots: a dotted
# string means an import path there. Template names are never resolved that way, so
# they may be namespaced with dots (``"phi3.fused_qkv"``).
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
# After the first dot a segment may start with a digit: user rules are named 'user.<family>.<n>'.
_DOTTED_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z0-9_][A-Za-z0-9_-]*)*$")


class RegistryKind(StrEnum):
    """The registries; values are the names used in messages and ``lookup``."""

    TEMPLATE = "template"
    INNER_WRAPPER = "inner_wrapper"
    COMPUTE_FACTORY = "compute_factory"
    ROUTER_ADAPTER = "router_adapter"
    TRAINING_ADAPTER = "training_adapter"

    @property
    def label(self) -> str:
        return self.value.replace("_", " ")


@dataclasses.dataclass(frozen=True)
class Provider:
    """Who registered an item: a plugin (with its distribution) or the user."""

    name: str
    distribution: str | None = None
    version: str | None = None

    def describe(self) -> str:
        """``plugin 'cp' (hp-plugin-cp 0.1.0)`` or ``register_* call (provider 'user')``."""
        if self.name == USER_PROVIDER and self.distribution is None:
            return "provider 'user' (a register_* call)"
        if self.distribution is None:
            return f"plugin {self.name!r}"
        version = f" {self.version}" if self.version else ""
        return f"plugin {self.name!r} ({self.distribution}{version})"


@dataclasses.dataclass(frozen=True, eq=False)
class RegisteredItem:
    """One registry entry and the plugin that registered it.

    ``meta`` holds the static requirements given at registration: ``needs_cp``,
    ``region_dispatch``, ``forward_style`` for inner wrappers; ``architectures`` for
    compute factories and architecture-scoped templates.
    """

    kind: RegistryKind
    name: str
    value: Any
    provider: str
    distribution: str | None
    version: str | None
    meta: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    #: ``(sizes, config) -> [Collective, ...]``: what one call issues (inner wrappers and
    #: compute factories; None: nothing declared), read by hp's step prediction.
    collectives: Callable[[Mapping[str, int], Mapping[str, Any]], Any] | None = None

    def describe_provider(self) -> str:
        return Provider(self.provider, self.distribution, self.version).describe()


@dataclasses.dataclass(frozen=True)
class PluginInfo:
    """One row of :func:`hp_core.plugins.plugin_report`.

    ``status``: ``builtin`` (the core's own plugin), ``loaded``, ``failed`` (``error``
    says why; none of its items were registered) or ``disabled`` (found but not loaded
    because of ``HP_DISABLE_PLUGIN_AUTOLOAD`` / ``HP_PLUGINS``; ``note`` says which).
    """

    name: str
    distribution: str | None
    version: str | None
    status: PluginStatus
    error: str | None = None
    items: int = 0
    note: str | None = None

    def describe(self) -> str:
        return Provider(self.name, self.distribution, self.version).describe()


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to a typo, or None."""
    best = difflib.get_close_matches(str(name), sorted(set(candidates)), n=1, cutoff=0.5)
    return best[0] if best else None


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    best = closest(name, candidates)
    return f" Did you mean {best!r}?" if best else ""


def check_name(kind: RegistryKind, name: Any, *, source: str) -> str:
    """Registry names are identifier-like (``[A-Za-z_][A-Za-z0-9_-]*``)."""
    dotted = kind is RegistryKind.TEMPLATE
    pattern = _DOTTED_NAME_RE if dotted else _NAME_RE
    if isinstance(name, str) and pattern.match(name):
        return name
    if dotted:
        rule = "letters, digits, '_' and '-', optionally namespaced with dots (e.g. 'phi3.fused_qkv')"
    else:
        rule = (
            "letters, digits, '_' and '-', starting with a letter or '_', and no dots (a dotted "
            "string in a plan means an import path, not a registry name)"
        )
    suggestion = ""
    if isinstance(name, str) and name:
        fixed = re.sub(r"[^A-Za-z0-9_\-.]" if dotted else r"[^A-Za-z0-9_-]", "_", name)
        if not re.match(r"[A-Za-z_]", fixed):
            fixed = "_" + fixed
        fixed = re.sub(r"\.{2,}", ".", fixed).strip(".") or "_"
        if (_DOTTED_NAME_RE if dotted else _NAME_RE).match(fixed):  # never suggest a name this refuses
            suggestion = f" e.g. {fixed!r}"
    raise InvalidRegistrationError(
        f"{source}: invalid {kind.label} name {name!r}.\n"
        f"Registry names use {rule}.\n"
        f"Fix: register it under a valid name{suggestion}."
    )


def _check_bool(value: Any, option: str, *, source: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, bool):
        allowed = "None, True or False" if allow_none else "True or False"
        raise InvalidRegistrationError(
            f"{source}: {option}={value!r} is not valid.\n"
            f"{option} must be {allowed}.\n"
            f"Fix: pass {option}={'None' if allow_none else 'False'} or another allowed value."
        )


def _check_architectures(value: Any, *, source: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        example = repr((value,)) if isinstance(value, str) else "('Qwen2MoeForCausalLM',)"
        raise InvalidRegistrationError(
            f"{source}: architectures={value!r} is not valid.\n"
            "architectures must be a tuple of HF architecture class names.\n"
            f"Fix: pass architectures={example}."
        )
    archs = tuple(value)
    for arch in archs:
        if not isinstance(arch, str) or not arch.isidentifier():
            raise InvalidRegistrationError(
                f"{source}: architecture {arch!r} is not valid.\n"
                "Architectures are HF model class names such as 'Qwen2MoeForCausalLM'.\n"
                "Fix: use the class name listed in the model config's 'architectures'."
            )
    return archs


def _require_callable(value: Any, what: str, *, source: str) -> None:
    if not callable(value):
        raise InvalidRegistrationError(
            f"{source}: {what} {value!r} is not callable.\n"
            f"A {what} must be a function.\n"
            f"Fix: pass the function object itself, not the result of calling it."
        )


def make_template(item: Any, provider: Provider) -> RegisteredItem:
    source = f"{provider.describe()}, template {getattr(item, 'name', item)!r}"
    name = getattr(item, "name", None)
    if not isinstance(name, str):
        raise InvalidRegistrationError(
            f"{provider.describe()}: template {item!r} has no 'name' attribute of type str.\n"
            "Templates and role rules are registered as objects with a 'name'.\n"
            "Fix: register e.g. hp_core.templates.RoleRule(name, pattern, role, architectures)."
        )
    check_name(RegistryKind.TEMPLATE, name, source=source)
    meta: dict[str, Any] = {"type": type(item).__name__}
    if hasattr(item, "architectures"):
        meta["architectures"] = _check_architectures(item.architectures, source=source)
    return _item(RegistryKind.TEMPLATE, name, item, provider, meta)


def make_inner_wrapper(
    name: Any,
    fn: Any,
    provider: Provider,
    *,
    needs_cp: Any = False,
    region_dispatch: Any = None,
    forward_style: Any = "any",
    collectives: Any = None,
) -> RegisteredItem:
    source = f"{provider.describe()}, inner wrapper {name!r}"
    check_name(RegistryKind.INNER_WRAPPER, name, source=source)
    _check_bool(needs_cp, "needs_cp", source=source)
    _check_bool(region_dispatch, "region_dispatch", source=source, allow_none=True)
    if forward_style not in FORWARD_STYLES:
        raise InvalidRegistrationError(
            f"{source}: forward_style={forward_style!r} is not valid.{did_you_mean(str(forward_style), FORWARD_STYLES)}\n"
            f"forward_style must be one of {', '.join(repr(s) for s in FORWARD_STYLES)}.\n"
            "Fix: 'qkv' for a module called as (q, k, v, ...), 'hf' for an HF attention module, "
            "'any' otherwise."
        )
    _require_injection(fn, "inner_wrapper", source=source)
    meta = {"needs_cp": needs_cp, "region_dispatch": region_dispatch, "forward_style": forward_style}
    _check_collectives(collectives, source=source)
    item = _item(RegistryKind.INNER_WRAPPER, name, fn, provider, meta)
    return dataclasses.replace(item, collectives=collectives)


def make_compute_factory(
    name: Any, factory: Any, provider: Provider, *, architectures: Any = (), collectives: Any = None
) -> RegisteredItem:
    source = f"{provider.describe()}, compute factory {name!r}"
    check_name(RegistryKind.COMPUTE_FACTORY, name, source=source)
    archs = _check_architectures(architectures, source=source)
    _require_injection(factory, "local_compute", source=source)
    _check_collectives(collectives, source=source)
    item = _item(RegistryKind.COMPUTE_FACTORY, name, factory, provider, {"architectures": archs})
    return dataclasses.replace(item, collectives=collectives)


def _check_collectives(value: Any, *, source: str) -> None:
    if value is not None:
        _require_callable(value, "collectives declaration", source=source)


def make_router_adapter(name: Any, adapter: Any, provider: Provider) -> RegisteredItem:
    source = f"{provider.describe()}, router adapter {name!r}"
    check_name(RegistryKind.ROUTER_ADAPTER, name, source=source)
    _require_callable(adapter, "router adapter", source=source)
    return _item(RegistryKind.ROUTER_ADAPTER, name, adapter, provider, {})


#: The optional methods of a training adapter, in the order a training step calls them.
TRAINING_ADAPTER_METHODS: tuple[str, ...] = ("prepare_model", "shard_batch", "after_backward")


def make_training_adapter(name: Any, adapter: Any, provider: Provider, *, axis: Any) -> RegisteredItem:
    source = f"{provider.describe()}, training adapter {name!r}"
    check_name(RegistryKind.TRAINING_ADAPTER, name, source=source)
    if not isinstance(axis, str) or not _NAME_RE.match(axis):
        raise InvalidRegistrationError(
            f"{source}: axis={axis!r} is not valid.\n"
            "axis is the name of the mesh axis the adapter serves, e.g. 'cp', 'tp' or 'ep'.\n"
            "Fix: pass axis='cp' (or the axis your adapter is for)."
        )
    methods = [m for m in TRAINING_ADAPTER_METHODS if getattr(adapter, m, None) is not None]
    for method in methods:
        if not callable(getattr(adapter, method)):
            raise InvalidRegistrationError(
                f"{source}: attribute {method!r} of {adapter!r} is not callable.\n"
                f"A training adapter's {', '.join(TRAINING_ADAPTER_METHODS)} are methods.\n"
                f"Fix: define {method}(...) as a method, or remove the attribute."
            )
    if not methods:
        raise InvalidRegistrationError(
            f"{source}: {adapter!r} has none of the methods {', '.join(TRAINING_ADAPTER_METHODS)}.\n"
            "A training adapter does at least one thing in a training step.\n"
            "Fix: register an object with e.g. a shard_batch(batch, context) method."
        )
    meta = {"axis": axis, "methods": tuple(methods)}
    return _item(RegistryKind.TRAINING_ADAPTER, name, adapter, provider, meta)


def _require_injection(fn: Any, kind: str, *, source: str) -> None:
    # Imported here: hp_core.injection imports hp_core.plugins (Target trust, lookups).
    from hp_core.injection import require_injection_meta

    if not callable(fn):
        _require_callable(fn, kind.replace("_", " ") + " function", source=source)
    require_injection_meta(fn, kind, source=source)


def _item(
    kind: RegistryKind, name: str, value: Any, provider: Provider, meta: dict[str, Any]
) -> RegisteredItem:
    return RegisteredItem(
        kind=kind,
        name=name,
        value=value,
        provider=provider.name,
        distribution=provider.distribution,
        version=provider.version,
        meta=MappingProxyType(meta),
    )


#: How a hook's ``register`` callback maps onto the validators.
HOOK_KINDS: dict[str, RegistryKind] = {
    "hp_register_templates": RegistryKind.TEMPLATE,
    "hp_register_inner_wrappers": RegistryKind.INNER_WRAPPER,
    "hp_register_compute_factories": RegistryKind.COMPUTE_FACTORY,
    "hp_register_router_adapters": RegistryKind.ROUTER_ADAPTER,
    "hp_register_training_adapters": RegistryKind.TRAINING_ADAPTER,
}


def make_register_callback(
    kind: RegistryKind, provider: Provider, sink: Callable[[RegisteredItem], None]
) -> Callable[..., None]:
    """The ``register`` callback a hook receives: validate, then hand to ``sink``."""
    if kind is RegistryKind.TEMPLATE:

        def register_template(item: Any) -> None:
            sink(make_template(item, provider))

        return register_template
    if kind is RegistryKind.INNER_WRAPPER:

        def register_inner_wrapper(
            name: str,
            fn: Callable[..., Any],
            *,
            needs_cp: bool = False,
            region_dispatch: bool | None = None,
            forward_style: str = "any",
            collectives: Callable[..., Any] | None = None,
        ) -> None:
            sink(
                make_inner_wrapper(
                    name,
                    fn,
                    provider,
                    needs_cp=needs_cp,
                    region_dispatch=region_dispatch,
                    forward_style=forward_style,
                    collectives=collectives,
                )
            )

        return register_inner_wrapper
    if kind is RegistryKind.COMPUTE_FACTORY:

        def register_compute_factory(
            name: str,
            factory: Callable[..., Any],
            *,
            architectures: tuple[str, ...] = (),
            collectives: Callable[..., Any] | None = None,
        ) -> None:
            sink(
                make_compute_factory(
                    name, factory, provider, architectures=architectures, collectives=collectives
                )
            )

        return register_compute_factory

    if kind is RegistryKind.TRAINING_ADAPTER:

        def register_training_adapter(name: str, adapter: Any, *, axis: str) -> None:
            sink(make_training_adapter(name, adapter, provider, axis=axis))

        return register_training_adapter

    def register_router_adapter(name: str, adapter: Callable[..., Any]) -> None:
        sink(make_router_adapter(name, adapter, provider))

    return register_router_adapter
