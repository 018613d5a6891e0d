"""Plugin discovery and loading: entry points → pluggy → validated, committed items.

Discovery is lazy and runs once per process (the first registry access or report
triggers it; :func:`reset_plugins` forgets it). Each plugin is loaded in isolation:
import, register with pluggy, ``check_pending``, call each of its hook
implementations with a ``register`` callback bound to it, validate every item, and
only then commit them all at once. A plugin that fails at any step is reported as
``failed`` and contributes nothing; the core and the other plugins carry on.

What counts as failing: any exception, and any other ``BaseException`` (``SystemExit``
from a ``sys.exit()`` at import or in a hook, ``GeneratorExit``, a custom subclass)
raised by the plugin's import, its registration with pluggy or its hooks. Only
``KeyboardInterrupt`` propagates, so Ctrl-C still stops hp. A plugin can therefore
neither end the process nor change the exit code of an unrelated command.

The import bound (``HP_PLUGIN_IMPORT_TIMEOUT``, seconds, default
:data:`DEFAULT_IMPORT_TIMEOUT`): Python cannot kill a thread or interrupt an import,
so each entry point is imported in its own daemon thread and the loader waits for it
with ``join(timeout)``. If the import has not finished by then, the plugin is
reported as failed ("did not finish within N s") and discovery goes on without it;
the thread is abandoned, not stopped: it keeps running (daemon, so it never keeps the
process alive) and whatever it eventually produces is ignored until the next
rediscovery. While it runs it holds the import lock of the module(s) it is importing,
so another import of *that* module blocks (a rediscovery times out on it again);
imports of any other module are unaffected. ``HP_PLUGIN_IMPORT_TIMEOUT=0`` (or
``off``/``none``) removes the bound and imports in the calling thread, as does
discovery started while the calling thread is itself importing a module (e.g. a
module that registers items at import time): that thread holds module locks an import
thread might need, so waiting for one could only time out. The bound covers the
import, where plugins do their expensive work; hooks run in the calling thread (they
only call ``register``).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as importlib_metadata
import math
import os
import threading
import types
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import pluggy

from hp_core import hookspecs
from hp_core.plugins._errors import DuplicateRegistrationError, PluginLoadError
from hp_core.plugins._items import (
    HOOK_KINDS,
    USER_PROVIDER,
    PluginInfo,
    PluginStatus,
    Provider,
    RegisteredItem,
    RegistryKind,
    closest,
    did_you_mean,
    make_register_callback,
)

__all__ = [
    "BUILTIN_PLUGIN_NAME",
    "DEFAULT_IMPORT_TIMEOUT",
    "ENTRY_POINT_GROUP",
    "ENV_DISABLE_AUTOLOAD",
    "ENV_IMPORT_TIMEOUT",
    "ENV_PLUGINS",
    "ENV_STRICT",
    "HpPluginWarning",
    "current_state",
    "import_timeout_from_env",
    "load_plugins",
    "plugin_packages",
    "plugin_report",
    "plugin_warnings",
    "register_plugin",
    "reset_plugins",
    "strict_from_env",
]

ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME
BUILTIN_PLUGIN_NAME = "builtin"
CORE_DISTRIBUTION = "hp-core"
ENV_DISABLE_AUTOLOAD = "HP_DISABLE_PLUGIN_AUTOLOAD"
ENV_PLUGINS = "HP_PLUGINS"
ENV_STRICT = "HP_PLUGINS_STRICT"
ENV_IMPORT_TIMEOUT = "HP_PLUGIN_IMPORT_TIMEOUT"
#: Seconds one plugin's import may take before it is reported as failed.
DEFAULT_IMPORT_TIMEOUT = 10.0
_UNBOUNDED = {"0", "off", "none", "inf"}

_TRUE = {"1", "true", "yes", "on"}
_HOOK_NAMES = tuple(HOOK_KINDS)


class HpPluginWarning(UserWarning):
    """A plugin problem that does not stop hp (e.g. an unknown name in ``HP_PLUGINS``)."""


class _PluginFailure(Exception):
    """Internal: one plugin failed; ``message`` is the report's ``error`` text."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclasses.dataclass
class _State:
    """Everything discovery produced. Replaced wholesale by a reload."""

    pm: pluggy.PluginManager
    items: dict[RegistryKind, dict[str, RegisteredItem]]
    report: list[PluginInfo]
    warnings: list[str]
    packages: set[str]

    @classmethod
    def empty(cls) -> _State:
        pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        pm.add_hookspecs(hookspecs)
        return cls(pm=pm, items={k: {} for k in RegistryKind}, report=[], warnings=[], packages=set())

    def failures(self) -> list[PluginInfo]:
        return [p for p in self.report if p.status == "failed"]

    def plugin_names(self) -> dict[str, PluginInfo]:
        return {p.name: p for p in self.report if p.status in ("loaded", "builtin")}


_LOCK = threading.RLock()
_STATE: _State | None = None
_LOADING = False
_LOADING_PLUGIN: str | None = None  # the plugin being imported / called, for messages
#: ``plugin`` is set (to the entry-point name) in the threads that import plugins.
_THREAD = threading.local()


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def strict_from_env() -> bool:
    """Whether ``HP_PLUGINS_STRICT`` asks for strict plugin loading."""
    return _env_true(ENV_STRICT)


def import_timeout_from_env() -> tuple[float | None, str | None]:
    """``(seconds or None for no bound, warning or None)`` from ``HP_PLUGIN_IMPORT_TIMEOUT``.

    Unset or empty: :data:`DEFAULT_IMPORT_TIMEOUT`. ``0``, ``off``, ``none``, ``inf``: no
    bound. Anything else that is not a positive number: the default, with a warning.
    """
    raw = os.environ.get(ENV_IMPORT_TIMEOUT)
    if raw is None or not raw.strip():
        return DEFAULT_IMPORT_TIMEOUT, None
    text = raw.strip().lower()
    if text in _UNBOUNDED:
        return None, None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isinf(value) and value > 0:
        return None, None
    if not math.isfinite(value) or value <= 0:
        return DEFAULT_IMPORT_TIMEOUT, (
            f"{ENV_IMPORT_TIMEOUT}={raw!r} is not a number of seconds; using "
            f"{DEFAULT_IMPORT_TIMEOUT:g} s. Set it to a positive number, or to 0 for no limit."
        )
    return value, None


def _loading_error() -> RuntimeError:
    who = f"plugin {_LOADING_PLUGIN!r}" if _LOADING_PLUGIN else "a plugin"
    return RuntimeError(
        f"{who} accessed the hp plugin registries while plugins are being loaded "
        "(from its import or a hook).\nPlugins only register items while loading.\n"
        "Fix: look items up lazily, at call time, not at import time."
    )


def check_not_loading_thread() -> None:
    """Refuse registry access from a plugin's import thread while discovery runs.

    Called before taking the registry lock: the discovering thread holds it while it waits
    for the import, so the import thread would otherwise block until its time runs out.
    """
    if _LOADING and getattr(_THREAD, "plugin", None) is not None:
        raise _loading_error()


# ------------------------------------------------------------------ public API


def current_state(*, strict: bool | None = None) -> _State:
    """The loaded state, discovering plugins on first use.

    ``strict=None`` follows ``HP_PLUGINS_STRICT``; when strict and any plugin failed,
    raises :class:`PluginLoadError`.
    """
    global _STATE
    check_not_loading_thread()
    with _LOCK:
        if _STATE is None:
            if _LOADING:
                raise _loading_error()
            _STATE = _load_all()
        state = _STATE
    if strict is None:
        strict = strict_from_env()
    if strict:
        _raise_if_failed(state)
    return state


def load_plugins(*, strict: bool = False) -> list[PluginInfo]:
    """Discover and load plugins now (a no-op if already done); return the report.

    ``strict=True`` (or ``HP_PLUGINS_STRICT=1``) raises :class:`PluginLoadError` when
    any plugin failed or ``HP_PLUGINS`` names a plugin that is not installed.
    """
    state = current_state(strict=strict or None)
    return list(state.report)


def plugin_report() -> list[PluginInfo]:
    """Every plugin found: built-in, loaded, failed and disabled. Never raises for failures."""
    return list(current_state(strict=False).report)


def plugin_warnings() -> list[str]:
    """Non-fatal problems found during discovery (e.g. unknown names in ``HP_PLUGINS``)."""
    return list(current_state(strict=False).warnings)


def plugin_packages() -> frozenset[str]:
    """Top-level import packages of the loaded hp plugin distributions (and ``hp_core``).

    ``hp_core.injection.Target`` imports a dotted path only from these packages (or
    ones the user trusts explicitly).
    """
    return frozenset(current_state(strict=False).packages)


def reset_plugins() -> None:
    """Forget every loaded plugin and user registration; the next access rediscovers.

    A test helper: call it after changing ``sys.path`` or the ``HP_*`` environment
    variables. Imported plugin modules stay in ``sys.modules``.
    """
    global _STATE
    with _LOCK:
        _STATE = None


def register_plugin(plugin: object, *, name: str) -> PluginInfo:
    """Load a plugin object (a module or an object with ``@hookimpl`` methods) by hand.

    Goes through the same validation as an entry-point plugin (provider ``name``,
    distribution None). On any failure raises :class:`PluginLoadError` and changes
    nothing. A module's top-level package joins :func:`plugin_packages`. Handy for
    testing a plugin without installing it.
    """
    if not isinstance(name, str) or not name.strip():
        raise PluginLoadError(
            f"register_plugin(name={name!r}): the provider name must be a non-empty string (it is how "
            "hp plugins and error messages name the plugin), e.g. register_plugin(plugin, name='my_plugin')."
        )
    check_not_loading_thread()
    with _LOCK:
        state = current_state(strict=False)
        info = _load_one(state, name, lambda: plugin, distribution=None, version=None, packages=())
        if info.status == "failed":
            # _load_one committed nothing; tell the caller instead of adding a report row.
            raise PluginLoadError(
                f"plugin {name!r} (registered with register_plugin) failed to load: {info.error}",
                [info],
            )
        state.report.append(info)
        if isinstance(plugin, types.ModuleType):
            # Its package is imported already; Target may import from it like any plugin's.
            state.packages.add(plugin.__name__.split(".", 1)[0])
        return info


# ------------------------------------------------------------------ loading


def _raise_if_failed(state: _State) -> None:
    failures = state.failures()
    if not failures and not state.warnings:
        return
    if failures:
        culprits = ", ".join(info.describe() for info in failures)
        lines = [f"hp plugin(s) failed to load (strict mode): {culprits}"]
    else:
        lines = [f"hp plugin selection problem (strict mode): {state.warnings[0]}"]
    lines.extend(f"- {info.describe()}: {info.error}" for info in failures)
    lines.extend(f"- {warning}" for warning in state.warnings)
    lines.append(
        "Fix: repair or uninstall the plugin, or leave it out with HP_PLUGINS=<names to load>; "
        f"unset {ENV_STRICT} / drop strict=True to load the rest anyway."
    )
    raise PluginLoadError("\n".join(lines), failures)


def _load_all() -> _State:
    global _LOADING
    _LOADING = True
    try:
        state = _State.empty()
        _load_builtin(state)
        _load_entry_points(state)
        for message in state.warnings:
            warnings.warn(message, HpPluginWarning, stacklevel=4)
        return state
    finally:
        _LOADING = False


def _core_version() -> str | None:
    try:
        return importlib_metadata.version(CORE_DISTRIBUTION)
    except importlib_metadata.PackageNotFoundError:
        return None


def _load_builtin(state: _State) -> None:
    def load() -> Any:
        from hp_core.plugins import _builtin

        return _builtin

    info = _load_one(
        state,
        BUILTIN_PLUGIN_NAME,
        load,
        distribution=CORE_DISTRIBUTION,
        version=_core_version(),
        packages=("hp_core",),
        status="builtin",
    )
    state.report.append(info)


def _entry_points() -> list[importlib_metadata.EntryPoint]:
    # By name; for two distributions with one entry-point name, sys.path order decides
    # (the earlier one loads, like an import would), and the other is reported failed.
    eps = importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
    return sorted(eps, key=lambda ep: ep.name)


def _dist_name(ep: importlib_metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None
    return dist.metadata["Name"] or None


def _dist_version(ep: importlib_metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return None if dist is None else dist.version


def _selection() -> tuple[set[str] | None, str | None]:
    """(names allowed by the environment or None for all, note for the others)."""
    if _env_true(ENV_DISABLE_AUTOLOAD):
        return set(), f"{ENV_DISABLE_AUTOLOAD}=1"
    raw = os.environ.get(ENV_PLUGINS)
    if raw is None:
        return None, None
    names = {n.strip() for n in raw.split(",") if n.strip()}
    return names, f"not listed in {ENV_PLUGINS}={raw}"


def _load_entry_points(state: _State) -> None:
    eps = _entry_points()
    allowed, note = _selection()
    timeout, problem = import_timeout_from_env()
    if problem is not None:
        state.warnings.append(problem)
    found = {ep.name for ep in eps}
    if allowed is not None and not _env_true(ENV_DISABLE_AUTOLOAD):
        for name in sorted(allowed - found - {BUILTIN_PLUGIN_NAME}):
            installed = ", ".join(sorted(found)) or "none"
            state.warnings.append(
                f"{ENV_PLUGINS} names plugin {name!r}, but no installed plugin has that "
                f"entry-point name.{did_you_mean(name, found)} Installed plugins: {installed}."
            )
    for ep in eps:
        dist, version = _dist_name(ep), _dist_version(ep)
        if allowed is not None and ep.name not in allowed:
            state.report.append(PluginInfo(ep.name, dist, version, "disabled", note=note))
            continue
        info = _load_one(
            state,
            ep.name,
            _entry_point_loader(ep, timeout),
            distribution=dist,
            version=version,
            packages=_top_level_packages(ep),
        )
        state.report.append(info)


def describe_exception(e: BaseException) -> str:
    """``Type: message`` (just ``Type`` when the message is empty)."""
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _importing_in_this_thread() -> bool:
    """Whether the calling thread is executing a module's import (holds a module lock).

    Reads CPython's import-lock table; where that is not available, answers False.
    """
    try:
        from importlib import _bootstrap

        me = threading.get_ident()
        for ref in list(_bootstrap._module_locks.values()):
            lock = ref()
            if lock is not None and getattr(lock, "owner", None) == me:
                return True
    except Exception:
        return False
    return False


def _entry_point_loader(ep: importlib_metadata.EntryPoint, timeout: float | None) -> Callable[[], Any]:
    """Import ``ep`` (bounded by ``timeout`` seconds, see the module docstring)."""
    what = f"importing entry point '{ep.name} = {ep.value}'"

    def failure(e: BaseException) -> _PluginFailure:
        if isinstance(e, KeyboardInterrupt):
            raise e
        return _PluginFailure(f"{what} raised {describe_exception(e)}")

    def load() -> Any:
        if timeout is None or _importing_in_this_thread():
            try:
                return ep.load()
            except BaseException as e:
                raise failure(e) from e
        outcome: dict[str, Any] = {}

        def run() -> None:
            _THREAD.plugin = ep.name
            try:
                outcome["value"] = ep.load()
            except BaseException as e:  # handed to the loading thread
                outcome["error"] = e

        thread = threading.Thread(target=run, name=f"hp-plugin-import:{ep.name}", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise _PluginFailure(
                f"{what} timed out: it did not finish within {timeout:g} s.\n"
                "hp stopped waiting and loaded the other plugins; the import goes on in a "
                "background thread whose result is ignored.\n"
                f"Fix: make the plugin's import fast, or set {ENV_IMPORT_TIMEOUT} to a higher "
                "number of seconds (0 for no limit)."
            )
        if "error" in outcome:
            error = outcome.pop("error")
            raise failure(error) from error
        return outcome["value"]

    return load


def _top_level_packages(ep: importlib_metadata.EntryPoint) -> set[str]:
    """Import packages a plugin distribution ships: top_level.txt, RECORD, entry point."""
    packages = {ep.module.split(".", 1)[0]}
    dist = getattr(ep, "dist", None)
    if dist is None:
        return packages
    top_level = dist.read_text("top_level.txt") or ""
    packages.update(line.strip() for line in top_level.splitlines() if line.strip())
    for path in dist.files or ():
        parts = path.parts
        head = parts[0] if parts else ""
        if head.startswith("__editable__") or head.endswith((".dist-info", ".egg-info")):
            continue
        if len(parts) > 1 and head.isidentifier() and head != "__pycache__":
            packages.add(head)
        elif len(parts) == 1 and head.endswith(".py") and head[:-3].isidentifier():
            packages.add(head[:-3])
    return packages


def _load_one(
    state: _State,
    name: str,
    load: Callable[[], Any],
    *,
    distribution: str | None,
    version: str | None,
    packages: Iterable[str],
    status: PluginStatus = "loaded",
) -> PluginInfo:
    """Load one plugin into ``state``; on failure leave ``state`` untouched."""
    global _LOADING_PLUGIN
    provider = Provider(name, distribution, version)
    registered = False
    _LOADING_PLUGIN = name
    try:
        taken = state.plugin_names().get(name)
        reserved = name == USER_PROVIDER or (name == BUILTIN_PLUGIN_NAME and status != "builtin")
        if taken is not None or reserved:
            owner = taken.describe() if taken else "hp itself (reserved name)"
            raise _PluginFailure(
                f"plugin name {name!r} is already used by {owner}.\n"
                "Plugin (entry-point) names are unique.\n"
                f"Fix: give the entry point in the [project.entry-points.{ENTRY_POINT_GROUP}] "
                "table of its pyproject.toml another name."
            )
        plugin = load()
        try:
            state.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as e:
            raise _PluginFailure(f"invalid hook implementation: {e}") from e
        except ValueError as e:
            raise _PluginFailure(f"cannot register the plugin object: {e}") from e
        registered = True
        _check_pending(state.pm, name)
        staged = _collect(state.pm, name, provider)
        _check_duplicates(state, staged)
    except KeyboardInterrupt:
        if registered:
            state.pm.unregister(name=name)
        raise
    except BaseException as e:  # a plugin never ends hp: everything else fails the plugin
        if registered:
            state.pm.unregister(name=name)
        message = e.message if isinstance(e, _PluginFailure) else f"loading it raised {describe_exception(e)}"
        return PluginInfo(name, distribution, version, "failed", error=message)
    finally:
        _LOADING_PLUGIN = None
    for item in staged:
        state.items[item.kind][item.name] = item
    state.packages.update(packages)
    return PluginInfo(name, distribution, version, status, items=len(staged))


def _check_pending(pm: pluggy.PluginManager, name: str) -> None:
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
        raise _PluginFailure(
            f"implements unknown hook {', '.join(parts)}.\n"
            f"hp hooks are: {', '.join(_HOOK_NAMES)}.\n"
            "Fix: rename the @hookimpl function to the hook's exact name."
        ) from None


def _collect(pm: pluggy.PluginManager, name: str, provider: Provider) -> list[RegisteredItem]:
    """Call each of the plugin's hook implementations with its own register callback."""
    staged: list[RegisteredItem] = []
    seen: dict[tuple[RegistryKind, str], RegisteredItem] = {}
    rejected: list[BaseException] = []

    for hook_name, kind in HOOK_KINDS.items():
        impls = [i for i in getattr(pm.hook, hook_name).get_hookimpls() if i.plugin_name == name]
        for impl in impls:
            if impl.hookwrapper or impl.wrapper:
                raise _PluginFailure(
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

            kwargs = {arg: guarded for arg in impl.argnames}
            try:
                returned = impl.function(**kwargs)
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # SystemExit, GeneratorExit, ... fail the plugin only
                if any(e is r for r in rejected):
                    raise _PluginFailure(
                        f"{hook_name} registered an invalid item: {describe_exception(e)}"
                    ) from e
                raise _PluginFailure(f"hook {hook_name} raised {describe_exception(e)}") from e
            if returned is not None:
                raise _PluginFailure(
                    f"hook {hook_name} returned {type(returned).__name__} instead of None.\n"
                    "Register hooks add items by calling register(...); a return value would be "
                    "silently lost.\n"
                    "Fix: call register(item) for each item instead of returning them."
                )
    return staged


def _check_duplicates(state: _State, staged: list[RegisteredItem]) -> None:
    try:
        check_conflicts(state, staged)
    except DuplicateRegistrationError as e:
        raise _PluginFailure(str(e)) from e


def check_conflicts(state: _State, staged: list[RegisteredItem]) -> None:
    """Raise DuplicateRegistrationError if ``staged`` collides with committed items."""
    for item in staged:
        existing = state.items[item.kind].get(item.name)
        if existing is not None:
            raise duplicate_error(existing, item)
    check_architecture_claims(state, staged)


def duplicate_error(existing: RegisteredItem, new: RegisteredItem) -> DuplicateRegistrationError:
    """The error for ``new`` colliding with ``existing``, naming both providers."""
    if new.provider == USER_PROVIDER and new.distribution is None:
        fix = f"choose another name for your {new.kind.label}"
        if existing.provider == USER_PROVIDER:
            fix += f", or unregister({new.kind.value!r}, {new.name!r}) first"
    else:
        fix = (
            f"rename one of them, or load only one plugin with {ENV_PLUGINS}=<names> "
            f"(e.g. {ENV_PLUGINS}={existing.provider})"
        )
    return DuplicateRegistrationError(
        f"{new.describe_provider()}: {new.kind.label} {new.name!r} is already registered by "
        f"{existing.describe_provider()}.\n"
        "Registry names are unique across all plugins and user registrations.\n"
        f"Fix: {fix}."
    )


def check_architecture_claims(state: _State, staged: Iterable[RegisteredItem]) -> None:
    """Each architecture may be suggested by one compute factory only."""
    claims = {
        arch: item
        for item in state.items[RegistryKind.COMPUTE_FACTORY].values()
        for arch in item.meta.get("architectures", ())
    }
    for item in staged:
        if item.kind is not RegistryKind.COMPUTE_FACTORY:
            continue
        for arch in item.meta.get("architectures", ()):
            other = claims.get(arch)
            if other is not None and other is not item:
                raise DuplicateRegistrationError(
                    f"compute factory {item.name!r} from {item.describe_provider()} claims "
                    f"architecture {arch!r}, already claimed by compute factory {other.name!r} from "
                    f"{other.describe_provider()}.\n"
                    "Each architecture has one suggested compute factory.\n"
                    "Fix: drop the architecture from one of them; users can still name either "
                    "factory explicitly."
                )
            claims[arch] = item
