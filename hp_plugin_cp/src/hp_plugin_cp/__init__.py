"""hp-plugin-cp: context parallelism (CP) for hp.

Ships the CP inner wrappers (``sdpa_qkv``, ``sdpa_hf``, ``flex_qkv``, ``flex_hf``,
registered through the ``cp`` entry point of group ``hp_core``), the packed K/V
all-gather, a batch sharding helper, and the loss/gradient reductions that make a CP
run equal a single-device one. See ``docs/cp.md``.
"""

from __future__ import annotations

from hp_plugin_cp.attention import cp_flex_attention, cp_sdpa, expand_kv_heads
from hp_plugin_cp.batch import SEQUENCE_KEYS, gather_sequence, shard_batch_for_cp
from hp_plugin_cp.collectives import all_gather_kv, cp_attention_collectives
from hp_plugin_cp.equivalence import HF_CP_OVERRIDES, cp_global_loss, cp_shard_batch
from hp_plugin_cp.errors import (
    CPBatchError,
    CPConfigError,
    CPError,
    CPMaskError,
    CPMisfireError,
    CPUnsupportedError,
)
from hp_plugin_cp.layout import (
    CP_LAYOUT_KEY,
    CPLayout,
    chunk_positions,
    gathered_positions,
    shard_sequence,
    unshard_sequence,
)
from hp_plugin_cp.loss import (
    CPCausalLMLoss,
    enable_cp_loss,
    reduce_cp_gradients,
    reduce_loss_over_cp,
)
from hp_plugin_cp.wrappers import flex_hf, flex_qkv, sdpa_hf, sdpa_qkv

__version__ = "0.1.0"

__all__ = [
    "CP_LAYOUT_KEY",
    "HF_CP_OVERRIDES",
    "SEQUENCE_KEYS",
    "CPBatchError",
    "CPCausalLMLoss",
    "CPConfigError",
    "CPError",
    "CPLayout",
    "CPMaskError",
    "CPMisfireError",
    "CPUnsupportedError",
    "__version__",
    "all_gather_kv",
    "chunk_positions",
    "cp_attention_collectives",
    "cp_flex_attention",
    "cp_global_loss",
    "cp_sdpa",
    "cp_shard_batch",
    "enable_cp_loss",
    "expand_kv_heads",
    "flex_hf",
    "flex_qkv",
    "gather_sequence",
    "gathered_positions",
    "reduce_cp_gradients",
    "reduce_loss_over_cp",
    "sdpa_hf",
    "sdpa_qkv",
    "shard_batch_for_cp",
    "shard_sequence",
    "unshard_sequence",
]
