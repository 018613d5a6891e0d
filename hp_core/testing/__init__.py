"""Testing helpers for hp and for plugin authors: a reusable gloo world and tiny models.

The one-call equivalence check is :func:`check_equivalence` (docs/testing.md), with the
comparison helpers it is built from; :class:`EquivalenceCase` holds one call's arguments for
the plugin conformance suite (:mod:`hp_core.testing.conformance`, which needs pytest and is
imported from there). The tiny models are :mod:`hp_core.presets`'
(re-exported here); the differential-test families are in :mod:`hp_core.testing.families`
and :mod:`hp_core.testing.family_matrix`.
"""

from __future__ import annotations

from hp_core.presets import FAMILIES, build_model, tiny_config
from hp_core.testing.compare import (
    allclose_excess,
    gather_full_grads,
    grads_excess,
    run_excess,
    snapshot_params,
    unmoved_params,
)
from hp_core.testing.equivalence import check_equivalence
from hp_core.testing.equivalence_case import EquivalenceCase, FamilyBatch, FamilyModel
from hp_core.testing.equivalence_rank import equivalence_on_rank
from hp_core.testing.equivalence_report import (
    EquivalenceArgumentError,
    EquivalenceBatchError,
    EquivalenceError,
    EquivalenceFactoryError,
    EquivalenceInputError,
    EquivalenceMeshError,
    EquivalenceOutputError,
    EquivalenceReport,
    EquivalenceRunError,
)
from hp_core.testing.sandbox import PluginSandbox
from hp_core.testing.world import (
    World,
    WorldError,
    WorldTaskError,
    WorldTimeoutError,
    get_world,
    shutdown_worlds,
)

__all__ = [
    "FAMILIES",
    "EquivalenceArgumentError",
    "EquivalenceBatchError",
    "EquivalenceCase",
    "EquivalenceError",
    "EquivalenceFactoryError",
    "EquivalenceInputError",
    "EquivalenceMeshError",
    "EquivalenceOutputError",
    "EquivalenceReport",
    "EquivalenceRunError",
    "FamilyBatch",
    "FamilyModel",
    "PluginSandbox",
    "World",
    "WorldError",
    "WorldTaskError",
    "WorldTimeoutError",
    "allclose_excess",
    "build_model",
    "check_equivalence",
    "equivalence_on_rank",
    "gather_full_grads",
    "get_world",
    "grads_excess",
    "run_excess",
    "shutdown_worlds",
    "snapshot_params",
    "tiny_config",
    "unmoved_params",
]
