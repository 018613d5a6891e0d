"""Name and architecture conflicts between a registration and the committed items."""

from __future__ import annotations

from collections.abc import Iterable

from hp_core.plugins._config import ENV_PLUGINS
from hp_core.plugins._errors import DuplicateRegistrationError
from hp_core.plugins._items import USER_PROVIDER, RegisteredItem, RegistryKind
from hp_core.plugins._state import PluginState

__all__ = ["check_architecture_claims", "check_conflicts", "duplicate_error"]


def check_conflicts(state: PluginState, staged: list[RegisteredItem]) -> None:
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


def check_architecture_claims(state: PluginState, staged: Iterable[RegisteredItem]) -> None:
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
                    f"architecture {arch!r}, already claimed by compute factory {other.name!r} "
                    f"from {other.describe_provider()}.\n"
                    "Each architecture has one suggested compute factory.\n"
                    "Fix: drop the architecture from one of them; users can still name either "
                    "factory explicitly."
                )
            claims[arch] = item
