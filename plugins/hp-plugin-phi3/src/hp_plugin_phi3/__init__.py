"""hp-plugin-phi3: Phi-3 parameter-role rules for hp, written as an outside author would.

It uses nothing but hp's public surface (``hp_core.hookspecs.hookimpl`` and
``hp_core.RoleRule`` / ``Role``) and is discovered through the ``phi3`` entry
point in the ``hp_core`` group.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
