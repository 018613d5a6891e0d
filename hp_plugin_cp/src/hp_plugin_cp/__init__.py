"""hp-plugin-cp: context parallelism (CP) for hp.

Ships the CP inner wrappers (``sdpa_qkv``, ``sdpa_hf``, ``flex_qkv``, ``flex_hf``), the
K/V all-gather collectives and a batch sharding helper. The plugin is discovered by
hp through the ``cp`` entry point in the ``hp_core`` group (see :mod:`hp_plugin_cp.plugin`).
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
