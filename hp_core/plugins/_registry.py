"""Read-only registry views, lookups, and programmatic registration for users."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, overload

from hp_core.errors import HpError
from hp_core.plugins._config import ENV_DISABLE_AUTOLOAD, ENV_PLUGINS
from hp_core.plugins._conflicts import check_conflicts
from hp_core.plugins._declared import ITEMS_GROUP, RecordedProvider, declared_providers
from hp_core.plugins._errors import (
    UnknownRegistryItemError,
    UnknownRegistryKindError,
    _UnknownRegistryKeyError,
)
from hp_core.plugins._items import USER_PROVIDER, Provider, RegisteredItem, RegistryKind
from hp_core.plugins._kinds import KIND_SPECS
from hp_core.plugins._manager import current_state
from hp_core.plugins._state import LOCK, check_not_loading_thread
from hp_core.spec.keywords import closest, did_you_mean

__all__ = [
    "COMPUTE_FACTORY_REGISTRY",
    "INNER_WRAPPER_REGISTRY",
    "ROUTER_ADAPTER_REGISTRY",
    "TEMPLATE_REGISTRY",
    "TRAINING_ADAPTER_REGISTRY",
    "PluginRegistry",
    "ProtectedRegistryItemError",
    "lookup",
    "register_compute_factory",
    "register_inner_wrapper",
    "register_router_adapter",
    "register_template",
    "register_training_adapter",
    "registered_items",
    "suggest_compute_factory",
    "unregister",
]

_USER = Provider(USER_PROVIDER)


class ProtectedRegistryItemError(HpError, ValueError):
    """``unregister`` was asked to remove an item a plugin registered."""


def _kind(kind: RegistryKind | str) -> RegistryKind:
    try:
        return RegistryKind(kind)
    except ValueError:
        names = [k.value for k in RegistryKind]
        raise UnknownRegistryKindError(
            f"unknown registry kind {kind!r}.{did_you_mean(str(kind), names)}\n"
            f"Registry kinds are: {', '.join(names)}."
        ) from None


def _declared_lines(kind: RegistryKind, name: str) -> tuple[list[str], str | None]:
    """What installed metadata says about ``name``: lines, and the fix it implies."""
    lines: list[str] = []
    fixes: list[str] = []
    for d in declared_providers(kind, name):
        if d.status == "disabled":
            why = f"its plugin {d.entry_point!r} is {(d.reason or '').removeprefix('it is ')}"
            fixes.append(
                f"load plugin {d.entry_point!r} (add it to {ENV_PLUGINS}, or unset {ENV_PLUGINS} "
                f"and {ENV_DISABLE_AUTOLOAD}), then check with `hp plugins`"
            )
        elif d.status == "failed":
            why = f"its plugin {d.entry_point!r} {(d.reason or '').removeprefix('it ')}"
            fixes.append(
                f"repair or reinstall {d.distribution} (`hp plugins` shows why plugin "
                f"{d.entry_point!r} fails)"
            )
        elif d.loaded:
            why = "its plugin is loaded but did not register it (its metadata is out of date)"
            fixes.append(f"reinstall {d.distribution}, or report it to its authors")
        else:
            why = d.reason or d.status
            fixes.append(f"reinstall {d.distribution} (`hp plugins` lists what is loaded)")
        lines.append(
            f"{name!r} is declared by the installed distribution {d.describe()}, but {why}."
        )
    return lines, ("; or ".join(fixes) if fixes else None)


def _unknown_message(
    kind: RegistryKind, name: object, recorded: RecordedProvider | None = None
) -> str:
    state = current_state()
    items = state.items[kind]
    plural = kind.label[:-1] + "ies" if kind.label.endswith("y") else kind.label + "s"
    best = closest(str(name), items) if items else None
    lines = [
        f"unknown {kind.label} {name!r}." + (f" Did you mean {best!r}?" if best else ""),
    ]
    declared, fix = _declared_lines(kind, str(name))
    lines.extend(declared)
    if not declared:
        lines.append(
            f"No installed distribution declares the {kind.label} {name!r} (entry-point group "
            f"{ITEMS_GROUP}, entry '{kind.value}.{name}')."
        )
        if recorded is not None:
            lines.append(
                f"The plan was made with {name!r} from {recorded.distribution}"
                f"{' ' + recorded.version if recorded.version else ''}."
            )
            fix = f"install it (pip install {recorded.requirement()})"
    if items:
        known = ", ".join(f"{n} ({item.describe_provider()})" for n, item in items.items())
        lines.append(f"Known {plural}: {known}.")
    else:
        lines.append(f"No {plural} are registered.")
    inactive = [p for p in state.report if p.status in ("failed", "disabled")]
    if inactive:
        listed = ", ".join(f"{p.name!r} ({p.status})" for p in inactive)
        lines.append(f"Not loaded: plugin(s) {listed}; run `hp plugins` for details.")
    if fix is None:
        fix = (
            "use a known name, or install the distribution that provides it (its documentation, "
            "or whoever made the plan, names it)"
        )
    lines.append(
        f"Fix: {fix}; or register it yourself with hp_core.plugins.{KIND_SPECS[kind].usage()}."
    )
    return "\n".join(lines)


class PluginRegistry(Mapping[str, RegisteredItem]):
    """A read-only ``name → RegisteredItem`` view of one registry.

    Loads plugins on first access. ``registry[name]`` and :meth:`get_item` raise
    :class:`UnknownRegistryItemError` (``registry[name]``'s error is also a ``KeyError``,
    as the ``Mapping`` protocol requires). Mutate it only through ``register_*`` /
    :func:`unregister`.
    """

    __slots__ = ("_kind",)

    def __init__(self, kind: RegistryKind | str) -> None:
        self._kind = _kind(kind)

    @property
    def kind(self) -> RegistryKind:
        return self._kind

    def _items(self) -> dict[str, RegisteredItem]:
        return current_state().items[self._kind]

    def __getitem__(self, name: str) -> RegisteredItem:
        item = self._items().get(name)
        if item is None:
            raise _UnknownRegistryKeyError(
                _unknown_message(self._kind, name), kind=self._kind.value, name=str(name)
            )
        return item

    def get_item(self, name: str, *, recorded: RecordedProvider | None = None) -> RegisteredItem:
        """The item registered as ``name``, or :class:`UnknownRegistryItemError`.

        ``recorded``: the provider a plan recorded for the item, named in the error when no
        installed distribution declares it.
        """
        item = self._items().get(name)
        if item is None:
            raise UnknownRegistryItemError(
                _unknown_message(self._kind, name, recorded), kind=self._kind.value, name=str(name)
            )
        return item

    def __contains__(self, name: object) -> bool:
        return name in self._items()

    @overload
    def get(self, name: str, /) -> RegisteredItem | None: ...
    @overload
    def get(self, name: str, /, default: Any) -> Any: ...
    def get(self, name: str, /, default: Any = None) -> Any:
        return self._items().get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._items()))

    def __len__(self) -> int:
        return len(self._items())

    def __repr__(self) -> str:
        return f"<{self._kind.label} registry: {', '.join(self) or 'empty'}>"


TEMPLATE_REGISTRY = PluginRegistry(RegistryKind.TEMPLATE)
INNER_WRAPPER_REGISTRY = PluginRegistry(RegistryKind.INNER_WRAPPER)
COMPUTE_FACTORY_REGISTRY = PluginRegistry(RegistryKind.COMPUTE_FACTORY)
ROUTER_ADAPTER_REGISTRY = PluginRegistry(RegistryKind.ROUTER_ADAPTER)
TRAINING_ADAPTER_REGISTRY = PluginRegistry(RegistryKind.TRAINING_ADAPTER)


def lookup(
    kind: RegistryKind | str, name: str, *, recorded: RecordedProvider | None = None
) -> RegisteredItem:
    """The item ``name`` of registry ``kind`` (``"inner_wrapper"``, ``"compute_factory"``, ...).

    ``recorded``: the provider a plan recorded for it (see :class:`RecordedProvider`).
    """
    return PluginRegistry(kind).get_item(name, recorded=recorded)


def registered_items(kind: RegistryKind | str | None = None) -> list[RegisteredItem]:
    """Every registered item (of one kind, or of all kinds in registry order)."""
    state = current_state()
    kinds = list(RegistryKind) if kind is None else [_kind(kind)]
    return [item for k in kinds for item in state.items[k].values()]


def suggest_compute_factory(architecture: str) -> str | None:
    """The compute factory registered for an HF architecture class name, or None."""
    for item in current_state().items[RegistryKind.COMPUTE_FACTORY].values():
        if architecture in item.meta.get("architectures", ()):
            return item.name
    return None


def _commit(item: RegisteredItem) -> RegisteredItem:
    check_not_loading_thread()
    with LOCK:
        state = current_state()
        check_conflicts(state, [item])
        state.items[item.kind][item.name] = item
    return item


def _user_register(kind: RegistryKind) -> Callable[..., RegisteredItem]:
    """The programmatic ``register_*`` function of ``kind``, derived from its row."""
    spec = KIND_SPECS[kind]

    def register(*args: Any, **kwargs: Any) -> RegisteredItem:
        return _commit(spec.build(_USER, args, kwargs, caller=spec.register_fn))

    register.__name__ = register.__qualname__ = spec.register_fn
    register.__signature__ = spec.signature.replace(  # type: ignore[attr-defined]
        return_annotation=RegisteredItem
    )
    register.__doc__ = (
        f'Register {spec.doc} under its name (provider ``"user"``); '
        f"the callback of ``{spec.hook_name}``.\n\n"
        "Raises InvalidRegistrationError (or InjectionDefinitionError, a TypeError) for a bad "
        "item and DuplicateRegistrationError for a taken name; the registry is unchanged then."
    )
    return register


register_template = _user_register(RegistryKind.TEMPLATE)
register_inner_wrapper = _user_register(RegistryKind.INNER_WRAPPER)
register_compute_factory = _user_register(RegistryKind.COMPUTE_FACTORY)
register_router_adapter = _user_register(RegistryKind.ROUTER_ADAPTER)
register_training_adapter = _user_register(RegistryKind.TRAINING_ADAPTER)


def unregister(kind: RegistryKind | str, name: str) -> RegisteredItem:
    """Remove a user-registered item and return it. Plugin items cannot be removed."""
    registry_kind = _kind(kind)
    check_not_loading_thread()
    with LOCK:
        item = lookup(registry_kind, name)
        if item.provider != USER_PROVIDER or item.distribution is not None:
            raise ProtectedRegistryItemError(
                f"{registry_kind.label} {name!r} is registered by {item.describe_provider()}, "
                "not by a register_* call.\n"
                "Only items registered programmatically can be unregistered.\n"
                "Fix: leave the plugin out with HP_PLUGINS=<other names>, or uninstall "
                f"{item.distribution or 'it'}."
            )
        del current_state().items[registry_kind][name]
    return item
