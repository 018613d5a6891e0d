"""hp: parallelize a PyTorch model over a DeviceMesh from declared per-module contracts.

The two verbs: :func:`plan` derives every boundary's contract from the model's structure
(plus your overrides) and :func:`apply` shards the parameters and wraps each boundary
with the communication its contract implies.
"""

from __future__ import annotations

from hp_core.apply import apply
from hp_core.checkpoint.dcp_errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLoadError,
    CheckpointMismatchError,
    CheckpointMissingFileError,
)
from hp_core.checkpoint.dcp_io import load_checkpoint, save_checkpoint
from hp_core.checkpoint.export import full_state_dict, iter_full_state_dict
from hp_core.checkpoint.export_errors import ExportArgumentError, ExportNotAppliedError
from hp_core.checkpoint.pretrained import load_pretrained
from hp_core.checkpoint.pretrained_errors import (
    CheckpointDtypeError,
    CheckpointKeysMissingError,
    CheckpointModelMismatchError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointShapeError,
    CheckpointUnexpectedKeysError,
    CorruptSafetensorsError,
    MissingShardFileError,
    NotOnMetaError,
    PretrainedLoadError,
)
from hp_core.context import ParallelContext
from hp_core.errors import HpError
from hp_core.hookspecs import PLUGIN_API_VERSION, hookimpl
from hp_core.injection import (
    InjectionCallError,
    InjectionMeta,
    Target,
    inner_wrapper,
    local_compute,
    require_injection_meta,
    trust_packages,
)
from hp_core.mesh import MeshSpec
from hp_core.planner.builtin_templates import builtin_template
from hp_core.planner.lints import MeshTypeError, TemplateBuildError
from hp_core.planner.local_proof import LocalProgramError
from hp_core.planner.templates.context import TemplateContext
from hp_core.planner.templates.module_rules import ModuleRule
from hp_core.planner.templates.roles import (
    BoundaryTemplate,
    Role,
    RoleRule,
    TemplateDefinitionError,
)
from hp_core.plans.errors import (
    ArgumentTypeError,
    DuplicateOverrideError,
    OverridesTypeError,
    PlanTypeError,
)
from hp_core.plans.example import ExampleCallError
from hp_core.plans.model import ShardingPlan
from hp_core.plans.overrides import OverrideEntry, dump_overrides, load_overrides
from hp_core.plans.yaml_io import dump_plan, load_plan
from hp_core.plugins import (
    register_compute_factory,
    register_inner_wrapper,
    register_router_adapter,
    register_template,
    register_training_adapter,
)
from hp_core.role_report import RoleReport, explain_roles
from hp_core.runtime.applied import AppliedModel, applied, finalize_grads
from hp_core.runtime.clip import clip_grad_norm_
from hp_core.runtime.fsdp_views import FsdpViewError
from hp_core.runtime.optim_state import OptimizerStateError, track_optimizer
from hp_core.runtime.state_dict import StateDictLayoutError
from hp_core.runtime.verdict import ApplyFailedError, RankTimeoutError
from hp_core.spec.axes import CP, DP, EP, TP, MeshAxisName
from hp_core.spec.keywords import UnknownFieldError
from hp_core.spec.module_spec import ModuleShardingSpec
from hp_core.spec.placements import (
    NamedPlacement,
    PlacementMismatchError,
    UnsupportedPartialError,
    format_named_placement,
    format_placement,
    parse_named_placement,
    parse_placement,
    resolve_placements,
)
from hp_core.verifier import VerificationError, VerifyReport, verify
from hp_core.verifier.advice import plan
from hp_core.version import __version__

__all__ = [
    "CP",
    "DP",
    "EP",
    "PLUGIN_API_VERSION",
    "TP",
    "AppliedModel",
    "ApplyFailedError",
    "ArgumentTypeError",
    "BoundaryTemplate",
    "CheckpointCorruptError",
    "CheckpointDtypeError",
    "CheckpointError",
    "CheckpointKeysMissingError",
    "CheckpointLoadError",
    "CheckpointMismatchError",
    "CheckpointMissingFileError",
    "CheckpointModelMismatchError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointShapeError",
    "CheckpointUnexpectedKeysError",
    "CorruptSafetensorsError",
    "DuplicateOverrideError",
    "ExampleCallError",
    "ExportArgumentError",
    "ExportNotAppliedError",
    "FsdpViewError",
    "HpError",
    "InjectionCallError",
    "InjectionMeta",
    "LocalProgramError",
    "MeshAxisName",
    "MeshSpec",
    "MeshTypeError",
    "MissingShardFileError",
    "ModuleRule",
    "ModuleShardingSpec",
    "NamedPlacement",
    "NotOnMetaError",
    "OptimizerStateError",
    "OverrideEntry",
    "OverridesTypeError",
    "ParallelContext",
    "PlacementMismatchError",
    "PlanTypeError",
    "PretrainedLoadError",
    "RankTimeoutError",
    "Role",
    "RoleReport",
    "RoleRule",
    "ShardingPlan",
    "StateDictLayoutError",
    "Target",
    "TemplateBuildError",
    "TemplateContext",
    "TemplateDefinitionError",
    "UnknownFieldError",
    "UnsupportedPartialError",
    "VerificationError",
    "VerifyReport",
    "__version__",
    "applied",
    "apply",
    "builtin_template",
    "clip_grad_norm_",
    "dump_overrides",
    "dump_plan",
    "explain_roles",
    "finalize_grads",
    "format_named_placement",
    "format_placement",
    "full_state_dict",
    "hookimpl",
    "inner_wrapper",
    "iter_full_state_dict",
    "load_checkpoint",
    "load_overrides",
    "load_plan",
    "load_pretrained",
    "local_compute",
    "parse_named_placement",
    "parse_placement",
    "plan",
    "register_compute_factory",
    "register_inner_wrapper",
    "register_router_adapter",
    "register_template",
    "register_training_adapter",
    "require_injection_meta",
    "resolve_placements",
    "save_checkpoint",
    "track_optimizer",
    "trust_packages",
    "verify",
]
