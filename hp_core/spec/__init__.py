"""The spec model: mesh axes, placements and their DSL, the per-boundary contract.

Everything here is plain data plus pure functions. Nothing touches a model or a process
group, so plans can be built, merged and compared anywhere. Modules:

- :mod:`~hp_core.spec.axes`: canonical mesh axis names;
- :mod:`~hp_core.spec.placements`: placements, their DSL, ``resolve_placements``;
- :mod:`~hp_core.spec.fields`: ``SPEC_FIELDS``, the one table of the spec's fields;
- :mod:`~hp_core.spec.module_spec`: ``ModuleShardingSpec`` (validated by that table);
- :mod:`~hp_core.spec.derived`: the planner-derived record a spec holds;
- :mod:`~hp_core.spec.merge`: the override merge rule;
- :mod:`~hp_core.spec.keywords`: typo-checked keyword arguments.

Inside hp_core, import from the defining module; this package re-exports for users.
"""

from __future__ import annotations

from hp_core.spec.axes import CANONICAL_AXES, CP, DP, EP, TP, MeshAxisName
from hp_core.spec.derived import Derived
from hp_core.spec.fields import AUTO, CONTRACT_FIELDS, NONE, SPEC_FIELDS, SpecField
from hp_core.spec.keywords import UnknownFieldError, close_matches, keyword_checked
from hp_core.spec.merge import IncompleteContractError, finalize_insert, merge_specs
from hp_core.spec.module_spec import ModuleShardingSpec, copy_spec
from hp_core.spec.placements import (
    PLACEMENT_GRAMMAR,
    NamedPlacement,
    PlacementMismatchError,
    PlacementSyntaxError,
    SpecValidationError,
    UnsupportedPartialError,
    check_lowerable,
    format_named_placement,
    format_placement,
    parse_named_placement,
    parse_placement,
    resolve_placements,
)

__all__ = [
    "AUTO",
    "CANONICAL_AXES",
    "CONTRACT_FIELDS",
    "CP",
    "DP",
    "EP",
    "NONE",
    "PLACEMENT_GRAMMAR",
    "SPEC_FIELDS",
    "TP",
    "Derived",
    "IncompleteContractError",
    "MeshAxisName",
    "ModuleShardingSpec",
    "NamedPlacement",
    "PlacementMismatchError",
    "PlacementSyntaxError",
    "SpecField",
    "SpecValidationError",
    "UnknownFieldError",
    "UnsupportedPartialError",
    "check_lowerable",
    "close_matches",
    "copy_spec",
    "finalize_insert",
    "format_named_placement",
    "format_placement",
    "keyword_checked",
    "merge_specs",
    "parse_named_placement",
    "parse_placement",
    "resolve_placements",
]
