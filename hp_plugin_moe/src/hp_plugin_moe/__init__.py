"""hp-plugin-moe: expert parallelism (EP) for hp.

Ships the EP archetype factories (``qwen2moe``, ``mixtral``, ``routed_only``,
``deepseekv3``), router adapters, all-to-all dispatch/combine and expert stacking.
The plugin is discovered by hp through the ``moe`` entry point in the ``hp_core``
group (see :mod:`hp_plugin_moe.plugin`).
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
