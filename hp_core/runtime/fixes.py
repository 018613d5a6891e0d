"""Pasteable fixes for refusals: override entries that make a boundary correct, if slower.

The universal one keeps a boundary whole on an axis: its parameters replicated there,
its inputs gathered, its output whole. The region then computes what a single device
computes (every rank the same), which is right for any module; the entry gather and the
exit slice are the only communication left.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch.distributed.tensor import Placement, Replicate

from hp_core.sharding_plan import dump_overrides
from hp_core.spec import ModuleShardingSpec

__all__ = ["keep_whole", "keep_whole_yaml"]


def _whole(layouts: Mapping[str, Mapping[str, Placement]] | None, axis: str) -> dict[str, dict[str, Placement]]:
    return {name: {a: (Replicate() if a == axis else p) for a, p in named.items()} for name, named in (layouts or {}).items()}


def keep_whole(spec: ModuleShardingSpec, axis: str = "tp") -> ModuleShardingSpec:
    """The override that keeps ``spec``'s boundary whole on ``axis`` (its entry/exit layouts kept)."""
    params = _whole(spec.params, axis)
    return ModuleShardingSpec(
        params=params,
        in_dst=_whole(spec.in_dst, axis),
        out_src=_whole(spec.out_src, axis),
        tp_divide_attrs=[] if axis == "tp" else None,
    )


def keep_whole_yaml(fqn: str, spec: ModuleShardingSpec, axis: str = "tp") -> str:
    """``keep_whole`` as an overrides YAML document (``load_overrides`` reads it back)."""
    return dump_overrides({fqn: keep_whole(spec, axis)}).rstrip("\n")
