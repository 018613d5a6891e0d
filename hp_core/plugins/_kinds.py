"""The registry kinds, each declared ONCE: a :class:`KindSpec` row per :class:`RegistryKind`.

A row ties together everything hp knows about one kind of registry item: the pluggy
hook that fills it, the validator (whose signature after ``provider`` *is* the
``register`` callback: positional parameters, then keyword-only options with their
defaults), the name of its read-only registry view, the name of the programmatic
``register_*`` function, a one-line description, and, for items a plan can name, the
plan field and the injection decorator the item must carry. The hook-to-kind map, the
``register`` callbacks, the ``register_*`` functions, the "register it with ..." hints
and the plan-item table are all derived from these rows; ``tests/test_plugin_docs.py``
fails when a kind has no row or a row's hook is undocumented.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from hp_core.hookspecs import (
    hp_register_compute_factories,
    hp_register_inner_wrappers,
    hp_register_router_adapters,
    hp_register_templates,
    hp_register_training_adapters,
)
from hp_core.plugins._items import Provider, RegisteredItem, RegistryKind
from hp_core.plugins._validate import (
    make_compute_factory,
    make_inner_wrapper,
    make_router_adapter,
    make_template,
    make_training_adapter,
)

__all__ = ["HOOK_KINDS", "KIND_SPECS", "REGISTRY_KINDS", "KindSpec", "make_register_callback"]


@dataclasses.dataclass(frozen=True)
class KindSpec:
    """One registry kind, declared once; everything else about the kind derives from it."""

    kind: RegistryKind
    #: The hookspec in :mod:`hp_core.hookspecs` that plugins implement to fill the registry.
    hook: Callable[..., None]
    #: ``validate(provider, *args, **options) -> RegisteredItem``; raises for a bad item.
    validate: Callable[..., RegisteredItem]
    #: Name of the read-only registry view exported by ``hp_core.plugins``.
    registry: str
    #: Name of the programmatic registration function (provider ``"user"``).
    register_fn: str
    #: What the kind holds, in a line (docstrings of the derived functions).
    doc: str
    #: The ``ModuleShardingSpec`` field that names items of this kind in a plan, if any.
    plan_field: str | None = None
    #: The injection kind ``resolve_injection`` resolves that field as, if any.
    injection: str | None = None

    @property
    def hook_name(self) -> str:
        """The hook's name, e.g. ``"hp_register_inner_wrappers"``."""
        return self.hook.__name__

    @property
    def signature(self) -> inspect.Signature:
        """The ``register`` callback's signature: the validator's, without ``provider``."""
        sig = inspect.signature(self.validate)
        return sig.replace(parameters=list(sig.parameters.values())[1:])

    @property
    def options(self) -> Mapping[str, Any]:
        """The keyword-only options and their defaults (``inspect.Parameter.empty``: required)."""
        return {
            p.name: p.default
            for p in self.signature.parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }

    def callback_text(self) -> str:
        """The callback as documented: ``register(name, fn, *, needs_cp=False, ...)``."""
        parts: list[str] = []
        star = False
        for p in self.signature.parameters.values():
            if p.kind is inspect.Parameter.KEYWORD_ONLY and not star:
                parts.append("*")
                star = True
            if p.default is inspect.Parameter.empty:
                parts.append(p.name)
            else:
                default = f'"{p.default}"' if isinstance(p.default, str) else repr(p.default)
                parts.append(f"{p.name}={default}")
        return f"register({', '.join(parts)})"

    def usage(self) -> str:
        """The shortest call of :attr:`register_fn`: ``register_training_adapter(name, adapter,
        axis=...)`` (positional parameters and required options only)."""
        parts = []
        for p in self.signature.parameters.values():
            if p.kind is not inspect.Parameter.KEYWORD_ONLY:
                parts.append(p.name)
            elif p.default is inspect.Parameter.empty:
                parts.append(f"{p.name}=...")
        return f"{self.register_fn}({', '.join(parts)})"

    def build(
        self, provider: Provider, args: tuple[Any, ...], kwargs: dict[str, Any], *, caller: str
    ) -> RegisteredItem:
        """Validate one ``caller(*args, **kwargs)`` registration by ``provider``.

        Arguments that do not fit the callback raise ``TypeError`` naming ``caller``.
        """
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{caller}() {e}") from None
        return self.validate(provider, *bound.args, **bound.kwargs)


#: The registry kinds, in registry order (``registered_items()``, ``hp plugins``).
REGISTRY_KINDS: tuple[KindSpec, ...] = (
    KindSpec(
        RegistryKind.TEMPLATE,
        hp_register_templates,
        make_template,
        registry="TEMPLATE_REGISTRY",
        register_fn="register_template",
        doc="a boundary template or parameter-role rule (any object with a ``name``)",
    ),
    KindSpec(
        RegistryKind.INNER_WRAPPER,
        hp_register_inner_wrappers,
        make_inner_wrapper,
        registry="INNER_WRAPPER_REGISTRY",
        register_fn="register_inner_wrapper",
        doc="an ``@inner_wrapper`` function (a replacement forward for an inner target)",
        plan_field="inner_wrapper",
        injection="inner_wrapper",
    ),
    KindSpec(
        RegistryKind.COMPUTE_FACTORY,
        hp_register_compute_factories,
        make_compute_factory,
        registry="COMPUTE_FACTORY_REGISTRY",
        register_fn="register_compute_factory",
        doc="a ``@local_compute`` factory (e.g. an expert-parallel MoE archetype)",
        plan_field="local_compute_fn",
        injection="local_compute",
    ),
    KindSpec(
        RegistryKind.ROUTER_ADAPTER,
        hp_register_router_adapters,
        make_router_adapter,
        registry="ROUTER_ADAPTER_REGISTRY",
        register_fn="register_router_adapter",
        doc="a MoE router adapter callable",
    ),
    KindSpec(
        RegistryKind.TRAINING_ADAPTER,
        hp_register_training_adapters,
        make_training_adapter,
        registry="TRAINING_ADAPTER_REGISTRY",
        register_fn="register_training_adapter",
        doc="a training adapter for mesh axis ``axis`` (what a training step does for it)",
    ),
)

#: Kind → its row.
KIND_SPECS: Mapping[RegistryKind, KindSpec] = {spec.kind: spec for spec in REGISTRY_KINDS}

#: Hook name → the kind it fills, in registry order.
HOOK_KINDS: Mapping[str, RegistryKind] = {spec.hook_name: spec.kind for spec in REGISTRY_KINDS}


def make_register_callback(
    kind: RegistryKind, provider: Provider, sink: Callable[[RegisteredItem], None]
) -> Callable[..., None]:
    """The ``register`` callback a hook receives: validate, then hand the item to ``sink``."""
    spec = KIND_SPECS[kind]

    def register(*args: Any, **kwargs: Any) -> None:
        sink(spec.build(provider, args, kwargs, caller="register"))

    register.__signature__ = spec.signature  # type: ignore[attr-defined]
    register.__doc__ = f"Register {spec.doc} for {provider.describe()}."
    return register
