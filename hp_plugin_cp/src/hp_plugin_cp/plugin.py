"""The hp plugin object of hp-plugin-cp (entry point ``cp`` in group ``hp_core``).

Registers the four CP inner wrappers. Each is ``needs_cp=True`` (preflight refuses it on
a mesh without an active cp axis) and ``region_dispatch=False`` (it communicates, so the
attention region runs on local tensors in both modes).
"""

from __future__ import annotations

from collections.abc import Callable

from hp_core.hookspecs import hookimpl
from hp_plugin_cp.wrappers import flex_hf, flex_qkv, sdpa_hf, sdpa_qkv

#: name → (wrapper, forward style), in registration order.
WRAPPERS = {
    "sdpa_qkv": (sdpa_qkv, "qkv"),
    "sdpa_hf": (sdpa_hf, "hf"),
    "flex_qkv": (flex_qkv, "qkv"),
    "flex_hf": (flex_hf, "hf"),
}


@hookimpl
def hp_register_inner_wrappers(register: Callable[..., None]) -> None:
    """Register ``sdpa_qkv``, ``sdpa_hf``, ``flex_qkv`` and ``flex_hf``."""
    for name, (fn, style) in WRAPPERS.items():
        register(name, fn, needs_cp=True, region_dispatch=False, forward_style=style)
