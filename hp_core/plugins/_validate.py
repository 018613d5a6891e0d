"""Validation of one registration: each ``make_*`` checks one item and returns it, or raises.

Validation is pure: a validator returns the ``RegisteredItem`` the registration would
become and touches no registry state, so a plugin's items can all be checked before any
is committed. A validator's signature after ``provider`` *is* the ``register`` callback
of its kind (see ``_kinds``): parameters before ``*`` are positional, the keyword-only
ones are the kind's options with their defaults.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from hp_core.injection import require_injection_meta
from hp_core.plugins._errors import InvalidRegistrationError
from hp_core.plugins._items import FORWARD_STYLES, Provider, RegisteredItem, RegistryKind
from hp_core.spec.keywords import did_you_mean

__all__ = [
    "TRAINING_ADAPTER_METHODS",
    "check_name",
    "make_compute_factory",
    "make_inner_wrapper",
    "make_router_adapter",
    "make_template",
    "make_training_adapter",
]

# Names that can appear as ``_target_`` in a plan must not contain dots: a dotted
# string means an import path there. Template names are never resolved that way, so
# they may be namespaced with dots (``"phi3.fused_qkv"``).
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
# After the first dot a segment may start with a digit: user rules are named 'user.<family>.<n>'.
_DOTTED_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z0-9_][A-Za-z0-9_-]*)*$")

#: The optional methods of a training adapter, in the order a training step calls them.
TRAINING_ADAPTER_METHODS: tuple[str, ...] = ("prepare_model", "shard_batch", "after_backward")


def check_name(kind: RegistryKind, name: Any, *, source: str) -> str:
    """Registry names are identifier-like (``[A-Za-z_][A-Za-z0-9_-]*``)."""
    dotted = kind is RegistryKind.TEMPLATE
    pattern = _DOTTED_NAME_RE if dotted else _NAME_RE
    if isinstance(name, str) and pattern.match(name):
        return name
    if dotted:
        rule = (
            "letters, digits, '_' and '-', optionally namespaced with dots (e.g. 'phi3.fused_qkv')"
        )
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
        # never suggest a name this refuses
        if (_DOTTED_NAME_RE if dotted else _NAME_RE).match(fixed):
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


def make_template(provider: Provider, item: Any) -> RegisteredItem:
    """A template or role rule: any object with a ``name``; optional ``architectures``."""
    source = f"{provider.describe()}, template {getattr(item, 'name', item)!r}"
    name = getattr(item, "name", None)
    if not isinstance(name, str):
        raise InvalidRegistrationError(
            f"{provider.describe()}: template {item!r} has no 'name' attribute of type str.\n"
            "Templates and role rules are registered as objects with a 'name'.\n"
            "Fix: register e.g. hp_core.RoleRule(name, pattern, role, architectures)."
        )
    check_name(RegistryKind.TEMPLATE, name, source=source)
    meta: dict[str, Any] = {"type": type(item).__name__}
    if hasattr(item, "architectures"):
        meta["architectures"] = _check_architectures(item.architectures, source=source)
    return _item(RegistryKind.TEMPLATE, name, item, provider, meta)


def make_inner_wrapper(
    provider: Provider,
    name: Any,
    fn: Any,
    *,
    needs_cp: Any = False,
    region_dispatch: Any = None,
    forward_style: Any = "any",
    collectives: Any = None,
) -> RegisteredItem:
    """An ``@inner_wrapper`` function with its static requirements (checked by preflight)."""
    source = f"{provider.describe()}, inner wrapper {name!r}"
    check_name(RegistryKind.INNER_WRAPPER, name, source=source)
    _check_bool(needs_cp, "needs_cp", source=source)
    _check_bool(region_dispatch, "region_dispatch", source=source, allow_none=True)
    if forward_style not in FORWARD_STYLES:
        raise InvalidRegistrationError(
            f"{source}: forward_style={forward_style!r} is not valid."
            f"{did_you_mean(str(forward_style), FORWARD_STYLES)}\n"
            f"forward_style must be one of {', '.join(repr(s) for s in FORWARD_STYLES)}.\n"
            "Fix: 'qkv' for a module called as (q, k, v, ...), 'hf' for an HF attention module, "
            "'any' otherwise."
        )
    _check_collectives(collectives, source=source)
    _require_injection(fn, "inner_wrapper", source=source)
    meta = {
        "needs_cp": needs_cp,
        "region_dispatch": region_dispatch,
        "forward_style": forward_style,
    }
    return _item(RegistryKind.INNER_WRAPPER, name, fn, provider, meta, collectives)


def make_compute_factory(
    provider: Provider,
    name: Any,
    factory: Any,
    *,
    architectures: Any = (),
    collectives: Any = None,
) -> RegisteredItem:
    """A ``@local_compute`` factory, suggested for the HF ``architectures`` it names."""
    source = f"{provider.describe()}, compute factory {name!r}"
    check_name(RegistryKind.COMPUTE_FACTORY, name, source=source)
    archs = _check_architectures(architectures, source=source)
    _check_collectives(collectives, source=source)
    _require_injection(factory, "local_compute", source=source)
    meta = {"architectures": archs}
    return _item(RegistryKind.COMPUTE_FACTORY, name, factory, provider, meta, collectives)


def make_router_adapter(provider: Provider, name: Any, adapter: Any) -> RegisteredItem:
    """A MoE router adapter: any callable."""
    source = f"{provider.describe()}, router adapter {name!r}"
    check_name(RegistryKind.ROUTER_ADAPTER, name, source=source)
    _require_callable(adapter, "router adapter", source=source)
    return _item(RegistryKind.ROUTER_ADAPTER, name, adapter, provider, {})


def make_training_adapter(
    provider: Provider, name: Any, adapter: Any, *, axis: Any
) -> RegisteredItem:
    """What a training loop does for mesh axis ``axis``: an object with step methods."""
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
            f"{source}: {adapter!r} has none of the methods "
            f"{', '.join(TRAINING_ADAPTER_METHODS)}.\n"
            "A training adapter does at least one thing in a training step.\n"
            "Fix: register an object with e.g. a shard_batch(batch, context) method."
        )
    meta = {"axis": axis, "methods": tuple(methods)}
    return _item(RegistryKind.TRAINING_ADAPTER, name, adapter, provider, meta)


def _check_collectives(value: Any, *, source: str) -> None:
    """``collectives`` is None or ``(sizes, config) -> [Collective]``: the item's comms per call."""
    if value is not None and not callable(value):
        raise InvalidRegistrationError(
            f"{source}: collectives={value!r} is not valid.\n"
            "collectives must be None or a function (sizes, config) -> sequence of Collective "
            "that declares the collectives the item issues per call.\n"
            "Fix: pass the function itself, or leave collectives=None."
        )


def _require_injection(fn: Any, kind: str, *, source: str) -> None:
    if not callable(fn):
        _require_callable(fn, kind.replace("_", " ") + " function", source=source)
    require_injection_meta(fn, kind, source=source)


def _item(
    kind: RegistryKind,
    name: str,
    value: Any,
    provider: Provider,
    meta: dict[str, Any],
    collectives: Callable[..., Any] | None = None,
) -> RegisteredItem:
    return RegisteredItem(
        kind=kind,
        name=name,
        value=value,
        provider=provider.name,
        distribution=provider.distribution,
        version=provider.version,
        meta=MappingProxyType(meta),
        collectives=collectives,
    )
