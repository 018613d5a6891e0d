"""The injection discipline: ``@local_compute``, ``@inner_wrapper`` and ``Target``.

Custom compute enters a plan only through these two decorators. Each checks the
function's signature when it is decorated (so a mistake fails at import, not in the
middle of a distributed run) and stamps ``fn._injection_meta``. At apply time the
framework fills the declared context names — the module and ``ctx``, the job's
:class:`~hp_core.ParallelContext` (plugin API 2) — and binds config keys by name.

Turning a registry name or a ``Target`` into the decorated function needs the plugin
registries, which sit above this module: that is :mod:`hp_core.resolve`.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

from hp_core.errors import HpError
from hp_core.spec.keywords import close_matches, keyword_checked

__all__ = [
    "CONTEXT_NAMES",
    "DECORATORS",
    "REQUIRED_CONTEXT",
    "InjectionBindingError",
    "InjectionCallError",
    "InjectionDefinitionError",
    "InjectionKind",
    "InjectionMeta",
    "Target",
    "TargetError",
    "UntrustedTargetError",
    "bind_injection",
    "check_config",
    "check_forward_compatible",
    "injection_name",
    "inner_wrapper",
    "local_compute",
    "require_injection_meta",
    "trust_packages",
    "user_trusted_packages",
]

InjectionKind = Literal["local_compute", "inner_wrapper"]

#: Framework-context parameter names each kind may declare (``ctx``: the ParallelContext).
CONTEXT_NAMES: dict[str, tuple[str, ...]] = {
    "local_compute": ("module", "ctx"),
    "inner_wrapper": ("target_module", "ctx"),
}
#: Context names each kind must declare.
REQUIRED_CONTEXT: dict[str, tuple[str, ...]] = {
    "local_compute": ("ctx",),
    "inner_wrapper": ("target_module", "ctx"),
}
#: The four mesh parameters of plugin API 1, which ``ctx`` replaced in API 2.
_API1_MESHES = ("mesh", "tp_mesh", "cp_mesh", "ep_mesh")
#: kind → the decorator's name, for messages.
DECORATORS = {"local_compute": "@local_compute", "inner_wrapper": "@inner_wrapper"}
_ROLE = {
    "local_compute": "a factory called once at apply time that returns compute_fn(module, "
    "*forward_args)",
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

    def __init__(
        self,
        message: str,
        *,
        name: str = "",
        provider: str = "",
        fqn: str | None = None,
        kind: str = "",
    ) -> None:
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


def injection_name(fn: Any) -> str:
    """``module.qualname`` of an injected function, for messages."""
    mod = getattr(fn, "__module__", None)
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{mod}.{qual}" if mod else str(qual)


def _analyse(fn: Any, kind: str) -> InjectionMeta:
    deco = DECORATORS[kind]
    name = injection_name(fn)
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
                f"{deco} {name}: '{star}{p.name}' is not allowed. "
                "Every parameter must be named so that typos in YAML config keys can be caught. "
                f"Fix: declare the context you need ({', '.join(allowed)}) and each config key "
                "as an explicit parameter."
            )
        if p.kind is p.POSITIONAL_ONLY:
            raise InjectionDefinitionError(
                f"{deco} {name}: parameter {p.name!r} is positional-only; the framework binds "
                "by name. Remove the '/' from the signature."
            )
        if p.name in _API1_MESHES:
            raise InjectionDefinitionError(
                f"{deco} {name}: parameter {p.name!r} is a context name of plugin API 1. Since "
                "plugin API 2 the framework passes one ParallelContext as 'ctx' instead of "
                f"{', '.join(_API1_MESHES)} (read ctx.mesh, ctx.tp_mesh, ctx.cp_mesh, ctx.ep_mesh; "
                f"None where the axis is inactive). Declare {', '.join(REQUIRED_CONTEXT[kind])}."
            )
        if p.name in allowed:
            if p.default is not p.empty:
                raise InjectionDefinitionError(
                    f"{deco} {name}: context parameter {p.name!r} must not have a default; "
                    f"the framework always fills it. "
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
            f"{', '.join(REQUIRED_CONTEXT[kind])} (ctx is the job's ParallelContext: "
            "ctx.mesh, ctx.tp_mesh, ctx.cp_mesh, ctx.ep_mesh, ctx.active_axes)."
        )
    return InjectionMeta(kind, tuple(context), tuple(config), tuple(required_config))


def local_compute(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a factory of a region's custom compute.

    Context parameters: ``ctx`` (required: the job's :class:`~hp_core.ParallelContext`)
    and ``module`` (optional), so ``factory(module, ctx, **config)``. Every other
    parameter is a config key bound by name from YAML. The factory runs once at apply
    time and returns ``compute_fn(module, *forward_args)``.
    """
    fn._injection_meta = _analyse(fn, "local_compute")  # type: ignore[attr-defined]
    return fn


def inner_wrapper(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a function that replaces an inner target's forward.

    Context parameters (both required): ``target_module`` and ``ctx`` (the job's
    :class:`~hp_core.ParallelContext`), so ``wrapper(target_module, ctx, **config)``.
    Returns the replacement forward (or installs it in place and returns None).
    """
    fn._injection_meta = _analyse(fn, "inner_wrapper")  # type: ignore[attr-defined]
    return fn


def require_injection_meta(fn: Any, kind: str, *, source: str) -> InjectionMeta:
    """The meta stamped by the decorator of ``kind``, or a TypeError that says which to use."""
    if kind not in DECORATORS:
        raise ValueError(f"unknown injection kind {kind!r}; expected one of {sorted(DECORATORS)}")
    meta = getattr(fn, "_injection_meta", None)
    deco = DECORATORS[kind]
    if not isinstance(meta, InjectionMeta):
        raise InjectionDefinitionError(
            f"{injection_name(fn)} (from {source}) is not decorated with {deco}. Injected code "
            "must "
            f"declare its contract: put {deco} (from hp_core) on the function; it is "
            f"{_ROLE[kind]}."
        )
    if meta.kind != kind:
        raise InjectionDefinitionError(
            f"{injection_name(fn)} (from {source}) is decorated with {DECORATORS[meta.kind]} but "
            "is "
            f"used where {deco} is needed. {deco} is {_ROLE[kind]}."
        )
    return meta


# ----------------------------------------------------------------------- binding


def check_config(
    fn: Callable[..., Any], meta: InjectionMeta, config: Mapping[str, Any], *, source: str
) -> None:
    """Config keys must be explicit, non-context parameters of ``fn``; required ones present."""
    collide = sorted(k for k in config if k in CONTEXT_NAMES[meta.kind])
    if collide:
        raise InjectionBindingError(
            f"{source}: config key(s) {collide} collide with framework context names of "
            f"{DECORATORS[meta.kind]} ({', '.join(CONTEXT_NAMES[meta.kind])}); the framework "
            "fills those. Remove them from the config."
        )
    unknown = [k for k in config if k not in meta.config_keys]
    if unknown:
        valid = list(meta.config_keys)
        key = unknown[0]
        best = close_matches(key, valid, n=1)
        hint = f" Did you mean {best[0]!r}?" if best else ""
        raise InjectionBindingError(
            f"{source}: unknown config key {key!r} for {injection_name(fn)}.{hint} "
            f"Valid config keys: {valid if valid else 'none (this function takes no config)'}."
        )
    missing = [k for k in meta.required_config if k not in config]
    if missing:
        raise InjectionBindingError(
            f"{source}: {injection_name(fn)} needs config key(s) {missing} (they have no default). "
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
                f"{source}: {injection_name(replacement)} must take {leading} leading positional "
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
            f"{source}: {injection_name(replacement)}{rsig} cannot stand in for forward{fsig}: "
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


def user_trusted_packages() -> frozenset[str]:
    """Top-level packages trusted by :func:`trust_packages` and ``$HP_TRUSTED_PACKAGES``.

    The installed hp plugins are trusted too: ``hp_core.resolve.trusted_packages`` adds them.
    """
    env = {p.strip() for p in os.environ.get("HP_TRUSTED_PACKAGES", "").split(",") if p.strip()}
    return frozenset(_USER_TRUSTED | env)


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
            raise TargetError(
                f"Target {self.target!r}: config must be a mapping, got {self.config!r}."
            )
        self.config = dict(self.config)
        for k in self.config:
            if not isinstance(k, str) or not k:
                raise TargetError(
                    f"Target {self.target!r}: config keys must be strings, got {k!r}."
                )

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
