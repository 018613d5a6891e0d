"""hp: parallelize a PyTorch model over a DeviceMesh from declared per-module contracts."""

from __future__ import annotations

from hp_core.hookspecs import hookimpl
from hp_core.injection import (
    InjectionMeta,
    Target,
    inner_wrapper,
    local_compute,
    require_injection_meta,
    trust_packages,
)
from hp_core.spec import (
    CP,
    DP,
    EP,
    TP,
    MeshAxisName,
    ModuleShardingSpec,
    NamedPlacement,
    PlacementMismatchError,
    format_named_placement,
    format_placement,
    parse_named_placement,
    parse_placement,
    resolve_placements,
)
from hp_core.templates import Role, RoleRule

__version__ = "0.1.0"

__all__ = [
    "CP",
    "DP",
    "EP",
    "TP",
    "InjectionMeta",
    "MeshAxisName",
    "ModuleShardingSpec",
    "NamedPlacement",
    "PlacementMismatchError",
    "Role",
    "RoleRule",
    "Target",
    "__version__",
    "format_named_placement",
    "format_placement",
    "hookimpl",
    "inner_wrapper",
    "local_compute",
    "parse_named_placement",
    "parse_placement",
    "require_injection_meta",
    "resolve_placements",
    "trust_packages",
]
