"""hp-plugin-bloom: BLOOM under tensor parallelism for hp, written as an outside author would.

It uses nothing but hp's public surface (``hp_core.hookspecs.hookimpl``, ``hp_core``'s
``RoleRule`` / ``Role`` / ``BoundaryTemplate`` / ``ModuleShardingSpec`` /
``inner_wrapper`` / ``HpError``) and is discovered through the ``bloom`` entry point in
the ``hp_core`` group. ``docs/plugin-authoring.md`` walks through how it was written.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
