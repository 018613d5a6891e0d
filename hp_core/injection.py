"""The injection discipline: ``@local_compute``, ``@inner_wrapper`` and ``Target``.

Custom compute enters a plan only through these two decorators. Each checks the
function's signature when it is decorated (so a mistake fails at import, not in the
middle of a distributed run) and stamps ``fn._injection_meta``. At apply time the
framework fills the declared context names and binds config keys by name.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from hp_core.errors import HpError
from hp_core.spec.keywords import close_matches, keyword_checked

__all__ = [
    "CONTEXT_NAMES",
    "REQUIRED_CONTEXT",
    "InjectionBindingError",
    "InjectionCallError",
    "InjectionDefinitionError",
    "InjectionKind",
    "InjectionMeta",
    "ResolvedInjection",
    "Target",
    "TargetError",
    "UntrustedTargetError",
    "bind_injection",
    "check_config",
    "check_forward_compatible",
    "inner_wrapper",
    "local_compute",
    "require_injection_meta",
    "resolve_injection",
    "trust_packages",
    "trusted_packages",
]

InjectionKind = Literal["local_compute", "inner_wrapper"]

_MESHES = ("mesh", "tp_mesh", "cp_mesh", "ep_mesh")

#: Framework-context parameter names each kind may declare.
CONTEXT_NAMES: dict[str, tuple[str, ...]] = {
    "local_compute": ("module", *_MESHES),
    "inner_wrapper": ("target_module", *_MESHES),
}
#: Context names each kind must declare.
REQUIRED_CONTEXT: dict[str, tuple[str, ...]] = {
    "local_compute": _MESHES,
    "inner_wrapper": ("target_module", *_MESHES),
}
_DECORATOR = {"local_compute": "@local_compute", "inner_wrapper": "@inner_wrapper"}
_ROLE = {
    "local_compute": "a factory called once at apply time that returns compute_fn(module, *forward_args)",
    "inner_wrapper": "a function that returns the replacement forward of the target module",
}


class InjectionDefinitionError(HpError, TypeError):
    """An injected function breaks the decorator discipline (raised at decoration time)."""


class InjectionBindingError(HpError, TypeError):
    """Config keys or forward parameters do not fit an injected function (apply time)."""


class InjectionCallError(HpError, RuntimeError):
    """An injected factory or wrapper raised when hp called it (apply time).

    The message names the function, the plugin that provides it and the module; the
    original exception is chained as ``__cause__``. ``name``, ``provider``, ``fqn`` and
    ``kind`` hold the same facts.
    """

    def __init__(self, message: str, *, name: str = "", provider: str = "", fqn: str | None = None, kind: str = "") -> None:
        super().__init__(message)
        self.name = name
        self.provider = provider
        self.fqn = fqn
        self.kind = kind


class TargetError(HpError, ValueError):
    """A ``Target`` (``{_target_: ...}``) that is malformed or cannot be resolved."""


class UntrustedTargetError(TargetError):
    """A dotted import path whose top-level package is neither an hp plugin nor trusted."""


@keyword_checked
@dataclasses.dataclass(frozen=True)
class InjectionMeta:
    """What the decorator learned from the signature."""

    kind: str
    context: tuple[str, ...]
    config_keys: tuple[str, ...] = ()
    required_config: tuple[str, ...] = ()


def _fn_name(fn: Any) -> str:
    mod = getattr(fn, "__module__", None)
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{mod}.{qual}" if mod else str(qual)


def _analyse(fn: Any, kind: str) -> InjectionMeta:
    deco = _DECORATOR[kind]
    name = _fn_name(fn)
    if not callable(fn):
        raise InjectionDefinitionError(f"{deco} applies to a function, got {fn!r}.")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise InjectionDefinitionError(
            f"{deco} {name}: its signature cannot be introspected ({e}). The framework binds "
            "context and config by parameter name, so decorate a plain Python function."
        ) from None
    allowed = CONTEXT_NAMES[kind]
    context: list[str] = []
    config: list[str] = []
    required_config: list[str] = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            star = "*" if p.kind is p.VAR_POSITIONAL else "**"
            raise InjectionDefinitionError(
                f"{deco} {name}: '{star}{p.name}' is not allowed. Every parameter must be named "
                f"so that typos in YAML config keys can be caught. Declare the context you need "
                f"({', '.join(allowed)}) and each config key as an explicit parameter."
            )
        if p.kind is p.POSITIONAL_ONLY:
            raise InjectionDefinitionError(
                f"{deco} {name}: parameter {p.name!r} is positional-only; the framework binds "
                "by name. Remove the '/' from the signature."
            )
        if p.name in allowed:
            if p.default is not p.empty:
                raise InjectionDefinitionError(
                    f"{deco} {name}: context parameter {p.name!r} must not have a default; "
                    f"the framework always fills it (None when its axis is inactive). "
                    f"Write '{p.name}' instead of '{p.name}={p.default!r}'."
                )
            context.append(p.name)
        else:
            config.append(p.name)
            if p.default is p.empty:
                required_config.append(p.name)
    missing = [c for c in REQUIRED_CONTEXT[kind] if c not in context]
    if missing:
        hint = ""
        for key in config:
            best = close_matches(key, missing, n=1)
            if best:
                hint = f" ({key!r} looks like a misspelling of {best[0]!r}.)"
                break
        raise InjectionDefinitionError(
            f"{deco} {name}: missing required context parameter(s) {', '.join(missing)}.{hint} "
            f"{deco} functions are {_ROLE[kind]}; they must declare "
            f"{', '.join(REQUIRED_CONTEXT[kind])} (ignore the ones you do not use)."
        )
    return InjectionMeta(kind, tuple(context), tuple(config), tuple(required_config))


def local_compute(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a factory of a region's custom compute.

    Context parameters: ``mesh, tp_mesh, cp_mesh, ep_mesh`` (required) and ``module``
    (optional). Every other parameter is a config key bound by name from YAML. The
    factory runs once at apply time and returns ``compute_fn(module, *forward_args)``.
    """
    fn._injection_meta = _analyse(fn, "local_compute")  # type: ignore[attr-defined]
    return fn


def inner_wrapper(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a function that replaces an inner target's forward.

    Context parameters (all required): ``target_module, mesh, tp_mesh, cp_mesh, ep_mesh``.
    Returns the replacement forward (or installs it in place and returns None).
    """
    fn._injection_meta = _analyse(fn, "inner_wrapper")  # type: ignore[attr-defined]
    return fn


def require_injection_meta(fn: Any, kind: str, *, source: str) -> InjectionMeta:
    """The meta stamped by the decorator of ``kind``, or a TypeError that says which to use."""
    if kind not in _DECORATOR:
        raise ValueError(f"unknown injection kind {kind!r}; expected one of {sorted(_DECORATOR)}")
    meta = getattr(fn, "_injection_meta", None)
    deco = _DECORATOR[kind]
    if not isinstance(meta, InjectionMeta):
        raise InjectionDefinitionError(
            f"{_fn_name(fn)} (from {source}) is not decorated with {deco}. Injected code must "
            f"declare its contract: put {deco} (from hp_core) on the function; it is "
            f"{_ROLE[kind]}."
        )
    if meta.kind != kind:
        raise InjectionDefinitionError(
            f"{_fn_name(fn)} (from {source}) is decorated with {_DECORATOR[meta.kind]} but is "
            f"used where {deco} is needed. {deco} is {_ROLE[kind]}."
        )
    return meta


# ----------------------------------------------------------------------- binding


def check_config(fn: Callable[..., Any], meta: InjectionMeta, config: Mapping[str, Any], *, source: str) -> None:
    """Config keys must be explicit, non-context parameters of ``fn``; required ones present."""
    collide = sorted(k for k in config if k in CONTEXT_NAMES[meta.kind])
    if collide:
        raise InjectionBindingError(
            f"{source}: config key(s) {collide} collide with framework context names of "
            f"{_DECORATOR[meta.kind]} ({', '.join(CONTEXT_NAMES[meta.kind])}); the framework "
            "fills those. Remove them from the config."
        )
    unknown = [k for k in config if k not in meta.config_keys]
    if unknown:
        valid = list(meta.config_keys)
        key = unknown[0]
        best = close_matches(key, valid, n=1)
        hint = f" Did you mean {best[0]!r}?" if best else ""
        raise InjectionBindingError(
            f"{source}: unknown config key {key!r} for {_fn_name(fn)}.{hint} "
            f"Valid config keys: {valid if valid else 'none (this function takes no config)'}."
        )
    missing = [k for k in meta.required_config if k not in config]
    if missing:
        raise InjectionBindingError(
            f"{source}: {_fn_name(fn)} needs config key(s) {missing} (they have no default). "
            f"Add them next to _target_, e.g. {{_target_: ..., {missing[0]}: ...}}."
        )


def bind_injection(
    fn: Callable[..., Any],
    meta: InjectionMeta,
    *,
    context: Mapping[str, Any],
    config: Mapping[str, Any],
    source: str,
) -> Any:
    """Call ``fn`` with every declared context name filled and config keys bound by name."""
    check_config(fn, meta, config, source=source)
    kwargs = {name: context.get(name) for name in meta.context}
    kwargs.update(config)
    return fn(**kwargs)


def check_forward_compatible(
    replacement: Callable[..., Any],
    forward: Callable[..., Any],
    *,
    leading: int = 0,
    source: str,
) -> None:
    """Check that ``replacement`` accepts every call the original ``forward`` accepts.

    ``leading`` counts extra positional parameters of the replacement that come before the
    forward's own (1 for ``compute_fn(module, *forward_args)``). Every named parameter of
    ``forward`` must exist in the replacement at the same position, unless the replacement
    takes ``*args`` / ``**kwargs`` for it.
    """
    try:
        rsig = inspect.signature(replacement)
        fsig = inspect.signature(forward)
    except (TypeError, ValueError) as e:
        raise InjectionBindingError(f"{source}: cannot introspect a signature ({e}).") from None
    rparams = list(rsig.parameters.values())
    if leading:
        positional = [p for p in rparams if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) < leading and not any(p.kind is p.VAR_POSITIONAL for p in rparams):
            raise InjectionBindingError(
                f"{source}: {_fn_name(replacement)} must take {leading} leading positional "
                f"parameter(s) (the module) before the forward's parameters."
            )
        rparams = rparams[leading:]
    has_var_pos = any(p.kind is p.VAR_POSITIONAL for p in rparams)
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in rparams)
    rpos = [p.name for p in rparams if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rnames = {p.name for p in rparams if p.kind is not p.POSITIONAL_ONLY}
    fparams = [p for p in fsig.parameters.values()]
    for i, p in enumerate(fparams):
        if p.kind is p.VAR_POSITIONAL and not has_var_pos:
            problem = f"the forward takes *{p.name} but the replacement does not"
        elif p.kind is p.VAR_KEYWORD and not has_var_kw:
            problem = f"the forward takes **{p.name} but the replacement does not"
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            if i < len(rpos) and rpos[i] == p.name:
                continue
            if i >= len(rpos) and has_var_pos:
                continue
            problem = f"parameter {i} of the forward is {p.name!r}, the replacement has " + (
                repr(rpos[i]) if i < len(rpos) else "nothing there"
            )
        elif p.kind is p.KEYWORD_ONLY and p.name not in rnames and not has_var_kw:
            problem = f"the forward takes keyword {p.name!r} but the replacement does not"
        else:
            continue
        raise InjectionBindingError(
            f"{source}: {_fn_name(replacement)}{rsig} cannot stand in for forward{fsig}: "
            f"{problem}. Give it the same parameters as the module's forward"
            + (" after the leading module parameter." if leading else ".")
        )


# ------------------------------------------------------------------------ Target

_USER_TRUSTED: set[str] = set()


def trust_packages(*names: str) -> None:
    """Allow ``Target`` dotted paths whose top-level package is one of ``names``.

    Plan files must not be able to import arbitrary code; installed hp plugins are
    trusted automatically. ``HP_TRUSTED_PACKAGES=a,b`` does the same from the environment.
    """
    for n in names:
        if not isinstance(n, str) or not n or "." in n:
            raise TargetError(
                f"trust_packages: expected top-level package names (no dots), got {n!r}. "
                "Pass e.g. trust_packages('mypkg') for mypkg.module.function."
            )
        _USER_TRUSTED.add(n)


def trusted_packages() -> frozenset[str]:
    """Top-level packages a Target may import from: installed hp plugins + user-trusted."""
    from hp_core.plugins import plugin_packages

    env = {p.strip() for p in os.environ.get("HP_TRUSTED_PACKAGES", "").split(",") if p.strip()}
    return frozenset(_USER_TRUSTED | env | set(plugin_packages()))


@keyword_checked
@dataclasses.dataclass
class Target:
    """A delayed reference: ``{_target_: NAME_OR_PATH, key: value, ...}``.

    ``NAME`` is a registry name; a dotted ``PATH`` (``pkg.module.attr`` or
    ``pkg.module:attr``) is imported only from trusted packages. The remaining keys are
    config bound by name to the factory's explicit parameters.
    """

    target: str
    config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target.strip():
            raise TargetError(f"Target: _target_ must be a non-empty string, got {self.target!r}.")
        if not isinstance(self.config, Mapping):
            raise TargetError(f"Target {self.target!r}: config must be a mapping, got {self.config!r}.")
        self.config = dict(self.config)
        for k in self.config:
            if not isinstance(k, str) or not k:
                raise TargetError(f"Target {self.target!r}: config keys must be strings, got {k!r}.")

    @property
    def is_path(self) -> bool:
        return "." in self.target or ":" in self.target

    @classmethod
    def from_dict(cls, raw: Any, *, path: str = "target") -> Target:
        if not isinstance(raw, Mapping) or "_target_" not in raw:
            raise TargetError(
                f"{path}: expected {{_target_: NAME_OR_PATH, key: value, ...}}, got {raw!r}."
            )
        config = {k: v for k, v in raw.items() if k != "_target_"}
        try:
            return cls(raw["_target_"], config)
        except TargetError as e:
            raise TargetError(f"{path}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"_target_": self.target, **self.config}


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
            return bind_injection(self.fn, self.meta, context=context, config=self.config, source=source)
        except HpError:
            raise
        except Exception as e:
            module = fqn if fqn is not None else _fqn_of(context, source)
            provider = self.provider_description or self.provider
            what = _DECORATOR[self.meta.kind] + (" factory" if self.meta.kind == "local_compute" else "")
            where = f" for module {module!r}" if module is not None else ""
            entry = f"the override for {module!r}" if module is not None else "the override"
            raise InjectionCallError(
                f"{source}: the {what} {self.name!r} (from {provider}) failed{where}: {type(e).__name__}: {e}\n"
                f"Fix: if its config is wrong, correct it in {entry}; if the function does not fit this "
                f"module, choose another one there{_or_report(provider)}. The original exception is "
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
        raise TargetError(f"{source}: cannot import module {mod_name!r} for {path!r}: {e}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        names = [n for n in dir(module) if not n.startswith("_")]
        best = close_matches(attr, names, n=1)
        hint = f" Did you mean {best[0]!r}?" if best else ""
        raise TargetError(f"{source}: module {mod_name!r} has no attribute {attr!r}.{hint}") from None


def resolve_injection(
    value: Any,
    kind: str,
    *,
    source: str,
    trusted: Iterable[str] | None = None,
) -> ResolvedInjection:
    """Resolve a registry name, decorated callable or Target into a ResolvedInjection.

    Config keys of a Target are checked against the factory's explicit parameters here,
    before anything is called or mutated.
    """
    if kind not in _DECORATOR:
        raise ValueError(f"unknown injection kind {kind!r}; expected one of {sorted(_DECORATOR)}")
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
            from hp_core.plugins import lookup

            item = lookup(_REGISTRY_KIND[kind], ref)
            fn = item.value
            provider = item.provider
            described = item.describe_provider()
    elif callable(ref):
        fn = ref
        name = _fn_name(ref)
        described = f"a function passed directly (module {getattr(ref, '__module__', None) or '?'!s})"
    else:
        raise TargetError(
            f"{source}: expected a registry name, a {_DECORATOR[kind]} function or a Target, got {ref!r}."
        )
    meta = require_injection_meta(fn, kind, source=source)
    check_config(fn, meta, config, source=source)
    return ResolvedInjection(
        fn=fn, meta=meta, config=dict(config), name=name, provider=provider, provider_description=described
    )
