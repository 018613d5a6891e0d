"""Pasteable fixes for refusals: override entries that make a boundary correct, if slower.

The universal one keeps a boundary whole on an axis: its parameters replicated there,
its inputs gathered, its output whole, its code run on local tensors. The region then
computes what a single device computes (every rank the same), which is right for any
module; the entry gather and the exit slice are the only communication left.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch.distributed.tensor import Placement, Replicate

from hp_core.plans.overrides import OverrideEntry, dump_overrides
from hp_core.plans.proposal import Proposal, entries_text, yaml_proposal
from hp_core.spec.module_spec import ModuleShardingSpec, PlacementMap, layout_map

__all__ = [
    "fix_match",
    "keep_whole",
    "keep_whole_proposal",
    "keep_whole_proposals",
    "keep_whole_yaml",
]


def _whole(layouts: PlacementMap | str | None, axis: str) -> dict[str, dict[str, Placement]]:
    return {
        name: {a: (Replicate() if a == axis else p) for a, p in named.items()}
        for name, named in layout_map(layouts).items()
    }


def keep_whole(spec: ModuleShardingSpec, axis: str = "tp") -> ModuleShardingSpec:
    """The override that keeps ``spec``'s boundary whole on ``axis`` (its entry/exit layouts kept).

    The region then runs on local tensors (``region_dispatch: false``): every value in it is
    whole, so DTensor has nothing left to check, and the module's own code runs exactly as
    on one device — also code that DTensor cannot dispatch.
    """
    params = _whole(spec.params, axis)
    return ModuleShardingSpec(
        params=params,
        in_dst=_whole(spec.in_dst, axis),
        out_src=_whole(spec.out_src, axis),
        tp_divide_attrs=[] if axis == "tp" else None,
        region_dispatch=False if not spec.has_injection else None,
    )


def fix_match(fqn: str, modules: Mapping[str, ModuleShardingSpec]) -> str:
    """The override key a fix for ``fqn`` should use: the same block in every layer, when
    those blocks have the same contract (one fix then repairs them all), else ``fqn``."""
    glob = layer_glob(fqn)
    if glob is None:
        return fqn
    pattern = re.compile(re.escape(glob).replace(r"\*", r"\d+"))
    same = [f for f in modules if pattern.fullmatch(f)]
    mine = modules.get(fqn)
    if mine is None or any(_contract(modules[f]) != _contract(mine) for f in same):
        return fqn
    return glob


def layer_glob(fqn: str) -> str | None:
    """``model.layers.*.self_attn`` for ``model.layers.0.self_attn``: the same block in every
    layer; None when ``fqn`` has no layer index, or ends in one (``h.*`` would also match
    every module inside each layer: an override glob's ``*`` crosses dots)."""
    glob = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", fqn)
    return glob if glob != fqn and not glob.endswith("*") else None


def _contract(spec: ModuleShardingSpec) -> tuple[object, ...]:
    return tuple(
        repr(getattr(spec, f))
        for f in (
            "params",
            "in_src",
            "in_dst",
            "out_src",
            "out_dst",
            "is_boundary",
            "region_dispatch",
        )
    )


def keep_whole_yaml(
    fqn: str, spec: ModuleShardingSpec, axis: str = "tp", *, match: str | None = None
) -> str:
    """``keep_whole`` as an overrides YAML document (``load_overrides`` reads it back).

    ``match`` (default ``fqn``) is the override key, e.g. a glob from :func:`fix_match`.
    """
    return dump_overrides({match or fqn: keep_whole(spec, axis)}).rstrip("\n")


def keep_whole_proposal(
    fqn: str, spec: ModuleShardingSpec, axis: str = "tp", *, match: str | None = None
) -> Proposal:
    """``keep_whole`` as a fix a refusal proposes (hp checks it before printing it)."""
    text = entries_text([OverrideEntry(match or fqn, keep_whole(spec, axis))])
    return yaml_proposal(text, f"keeping {match or fqn} whole on {axis}")


def keep_whole_proposals(fqn: str, spec: ModuleShardingSpec, axis: str = "tp") -> list[Proposal]:
    """Keeping ``fqn`` whole: for the same block in every layer first (``layers.*.attn``),
    then for ``fqn`` alone — where the contract is not known to be shared, hp's check of each
    fix decides which holds."""
    glob = layer_glob(fqn)
    exact = keep_whole_proposal(fqn, spec, axis)
    return [keep_whole_proposal(fqn, spec, axis, match=glob), exact] if glob else [exact]
