"""Sharding plans as plain data: the plan model, its document codec, YAML I/O and overrides.

- :mod:`~hp_core.plans.model`: ``ShardingPlan`` and its fingerprint;
- :mod:`~hp_core.plans.spec_codec`: one spec <-> plain data;
- :mod:`~hp_core.plans.codec`: a plan <-> its document (``plan_to_dict`` / ``plan_from_dict``);
- :mod:`~hp_core.plans.yaml_io`: YAML text and files (``dump_plan`` / ``load_plan``);
- :mod:`~hp_core.plans.overrides`: ``OverrideEntry``, reading them, ``resolve_overrides``;
- :mod:`~hp_core.plans.explain`: a plan as text;
- :mod:`~hp_core.plans.errors`: the errors.

Inside hp_core, import from the defining module; this package re-exports for users.
"""

from __future__ import annotations

from hp_core.plans.codec import plan_from_dict, plan_to_dict
from hp_core.plans.errors import (
    ArgumentTypeError,
    DuplicateOverrideError,
    IncompleteOverrideError,
    OverrideError,
    OverrideMatchWarning,
    OverridesTypeError,
    PlanError,
    PlanTypeError,
    PlanYAMLError,
    PlanYAMLInputLimitError,
)
from hp_core.plans.explain import explain
from hp_core.plans.model import ShardingPlan
from hp_core.plans.overrides import (
    WHEN_VALUES,
    OverrideEntry,
    OverridesLike,
    compile_glob,
    dump_overrides,
    is_glob,
    load_overrides,
    overrides_to_list,
    resolve_overrides,
)
from hp_core.plans.spec_codec import OVERRIDE_FIELDS, PLAN_FORMAT_VERSION, USER_FIELDS
from hp_core.plans.yaml_io import dump_plan, load_plan
from hp_core.spec.module_spec import copy_spec

__all__ = [
    "OVERRIDE_FIELDS",
    "PLAN_FORMAT_VERSION",
    "USER_FIELDS",
    "WHEN_VALUES",
    "ArgumentTypeError",
    "DuplicateOverrideError",
    "IncompleteOverrideError",
    "OverrideEntry",
    "OverrideError",
    "OverrideMatchWarning",
    "OverridesLike",
    "OverridesTypeError",
    "PlanError",
    "PlanTypeError",
    "PlanYAMLError",
    "PlanYAMLInputLimitError",
    "ShardingPlan",
    "compile_glob",
    "copy_spec",
    "dump_overrides",
    "dump_plan",
    "explain",
    "is_glob",
    "load_overrides",
    "load_plan",
    "overrides_to_list",
    "plan_from_dict",
    "plan_to_dict",
    "resolve_overrides",
]
