"""The hp plugin object of hp-plugin-cp (entry point ``cp`` in group ``hp_core``).

Not implemented yet: ``hp_register_inner_wrappers`` registers NOTHING for now. The CP
wrappers ``sdpa_qkv``, ``sdpa_hf``, ``flex_qkv`` and ``flex_hf`` (each ``needs_cp=True``,
``region_dispatch=False``) arrive with the CP implementation in a later change; the
hook is here so that discovery, provenance and ``hp plugins`` already work end to end.
"""

from __future__ import annotations

from collections.abc import Callable

from hp_core.hookspecs import hookimpl


@hookimpl
def hp_register_inner_wrappers(register: Callable[..., None]) -> None:
    """Register the CP inner wrappers (none yet; see the module docstring)."""
    del register  # nothing to register until the CP wrappers land
