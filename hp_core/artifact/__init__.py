"""Artifacts: freeze a plan into a signed, byte-stable file and rebuild it (docs/artifacts.md).

Upstream hyper-parallel calls this ``codegen/plan``; it generates no code.

``freeze(plan)`` and ``rebuild(meta)`` walk one table, :data:`SPEC_FIELDS`, that
classifies every ``ModuleShardingSpec`` field. An artifact adds the inputs that produced
the plan and a signature; ``write_artifact`` / ``read_artifact`` store and verify it.
See ``docs/artifacts.md``.
"""

from __future__ import annotations

from hp_core.artifact.check import check_against_model
from hp_core.artifact.compare import plan_differences, same_plan
from hp_core.artifact.freeze import FreezeError, freeze
from hp_core.artifact.rebuild import MetaError, ModelMismatchError, rebuild, restore_model_metadata
from hp_core.artifact.signed import (
    FORMAT_VERSION,
    Artifact,
    ArtifactError,
    ArtifactFormatError,
    ArtifactLimitError,
    ArtifactRegistryError,
    ArtifactSchemaError,
    ArtifactSignatureError,
    ArtifactVersionError,
    canonical_json,
    content_signature,
    dumps_artifact,
    loads_artifact,
    make_artifact,
    missing_registry_items,
    model_digest,
    read_artifact,
    version_drift,
    write_artifact,
)
from hp_core.spec.fields import SPEC_FIELDS, SpecField

__all__ = [
    "FORMAT_VERSION",
    "SPEC_FIELDS",
    "Artifact",
    "ArtifactError",
    "ArtifactFormatError",
    "ArtifactLimitError",
    "ArtifactRegistryError",
    "ArtifactSchemaError",
    "ArtifactSignatureError",
    "ArtifactVersionError",
    "FreezeError",
    "MetaError",
    "ModelMismatchError",
    "SpecField",
    "canonical_json",
    "check_against_model",
    "content_signature",
    "dumps_artifact",
    "freeze",
    "loads_artifact",
    "make_artifact",
    "missing_registry_items",
    "model_digest",
    "plan_differences",
    "read_artifact",
    "rebuild",
    "restore_model_metadata",
    "same_plan",
    "version_drift",
    "write_artifact",
]
