"""The hp plugin object of hp-plugin-moe (entry point ``moe`` in group ``hp_core``).

Not implemented yet: both hooks register NOTHING for now. The EP archetype factories
(``qwen2moe``, ``mixtral``, ``routed_only``, ``deepseekv3``, with the HF architectures
they are suggested for) and the router adapters arrive with the EP implementation in a
later change; the hooks are here so that discovery, provenance and ``hp plugins``
already work end to end.
"""

from __future__ import annotations

from collections.abc import Callable

from hp_core.hookspecs import hookimpl


@hookimpl
def hp_register_compute_factories(register: Callable[..., None]) -> None:
    """Register the EP compute factories (none yet; see the module docstring)."""
    del register  # nothing to register until the EP factories land


@hookimpl
def hp_register_router_adapters(register: Callable[..., None]) -> None:
    """Register the router adapters (none yet; see the module docstring)."""
    del register  # nothing to register until the router adapters land
