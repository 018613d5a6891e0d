"""Calling one plugin's hooks through pluggy, each with a ``register`` bound to that plugin.

Every hook is called per plugin through ``pm.subset_hook_caller(hook, remove_plugins=<all
other plugins>)``: the ``register`` callback is bound to the plugin (so each item records
its provider), and the call still goes through pluggy's hook execution, so pluggy's
tracing (``pm.trace``, ``pm.enable_tracing()``), ``pm.add_hookcall_monitoring`` and the
``tryfirst`` / ``trylast`` order of a plugin's implementations all apply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

from hp_core.plugins._errors import DuplicateRegistrationError
from hp_core.plugins._items import Provider, RegisteredItem, RegistryKind
from hp_core.plugins._kinds import HOOK_KINDS, make_register_callback
from hp_core.plugins._state import PluginFailure, describe_exception
from hp_core.spec.keywords import closest

__all__ = ["check_pending", "collect"]

_HOOK_NAMES = tuple(HOOK_KINDS)


def check_pending(pm: pluggy.PluginManager, name: str) -> None:
    """Fail plugin ``name`` if it implements a hook hp does not have (e.g. a typo)."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError:
        unknown = sorted(
            hook_name
            for hook_name, caller in vars(pm.hook).items()
            if isinstance(caller, pluggy.HookCaller)
            and caller.spec is None
            and any(impl.plugin_name == name for impl in caller.get_hookimpls())
        )
        parts = []
        for hook_name in unknown:
            best = closest(hook_name, _HOOK_NAMES)
            hint = f" (did you mean {best!r}?)" if best else ""
            parts.append(f"{hook_name!r}{hint}")
        raise PluginFailure(
            f"implements unknown hook {', '.join(parts)}.\n"
            f"hp hooks are: {', '.join(_HOOK_NAMES)}.\n"
            "Fix: rename the @hookimpl function to the hook's exact name."
        ) from None


def collect(pm: pluggy.PluginManager, name: str, provider: Provider) -> list[RegisteredItem]:
    """Call each hook of plugin ``name`` (registered in ``pm``); return its items, unvalidated
    against other plugins. Raises ``PluginFailure`` for anything wrong."""
    staged: list[RegisteredItem] = []
    seen: dict[tuple[RegistryKind, str], RegisteredItem] = {}
    rejected: list[BaseException] = []
    plugin = pm.get_plugin(name)
    others = [p for p in pm.get_plugins() if p is not plugin]

    for hook_name, kind in HOOK_KINDS.items():
        impls = [i for i in getattr(pm.hook, hook_name).get_hookimpls() if i.plugin_name == name]
        if not impls:
            continue
        if any(impl.hookwrapper or impl.wrapper for impl in impls):
            raise PluginFailure(
                f"hook {hook_name} is declared as a wrapper.\n"
                "Register hooks are called once per plugin and cannot wrap other plugins.\n"
                "Fix: use a plain @hookimpl."
            )

        def sink(item: RegisteredItem, kind: RegistryKind = kind) -> None:
            key = (kind, item.name)
            if key in seen:
                err = DuplicateRegistrationError(
                    f"{provider.describe()}: {kind.label} {item.name!r} is registered twice "
                    "by this plugin.\nRegistry names are unique.\n"
                    "Fix: register each name once."
                )
                rejected.append(err)
                raise err
            seen[key] = item
            staged.append(item)

        callback = make_register_callback(kind, provider, sink)

        def guarded(*args: Any, _cb: Callable[..., None] = callback, **kwargs: Any) -> None:
            try:
                _cb(*args, **kwargs)
            except Exception as e:
                rejected.append(e)
                raise

        call = pm.subset_hook_caller(hook_name, remove_plugins=others)
        try:
            returned = call(register=guarded)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit, GeneratorExit, ... fail the plugin only
            if any(e is r for r in rejected):
                raise PluginFailure(
                    f"{hook_name} registered an invalid item: {describe_exception(e)}"
                ) from e
            raise PluginFailure(f"hook {hook_name} raised {describe_exception(e)}") from e
        if returned:  # pluggy collects the results that are not None
            raise PluginFailure(
                f"hook {hook_name} returned {type(returned[0]).__name__} instead of None.\n"
                "Register hooks add items by calling register(...); a return value would be "
                "silently lost.\n"
                "Fix: call register(item) for each item instead of returning them."
            )
    return staged
