"""Checking an artifact against a model: the same model, every FQN present, the planner's lints."""

from __future__ import annotations

from torch import nn

from hp_core.artifact.rebuild import restore_model_metadata
from hp_core.artifact.signed import Artifact, model_digest
from hp_core.mesh import MeshSpec
from hp_core.planner.lints import lint_plan
from hp_core.spec.keywords import close_matches

__all__ = ["check_against_model"]


def check_against_model(artifact: Artifact, model: nn.Module) -> list[str]:
    """Problems that keep ``artifact`` from applying to ``model`` (empty: none).

    The model must be the one the artifact was frozen for (same digest), hold every
    planned module, and pass the planner's lints (:func:`hp_core.planner.lints.lint_plan`:
    mesh axes, parameter shapes and divisibility, head counts, every trainable parameter
    covered by exactly one boundary).
    """
    problems: list[str] = []
    recorded = artifact.inputs.get("model", {}).get("digest")
    actual = model_digest(model)
    if recorded != actual:
        problems.append(
            f"model: the artifact was frozen for another model (digest {str(recorded)[:19]}..., "
            f"this model {actual[:19]}...: class, config or parameter shapes differ). Re-freeze it "
            "for this model."
        )
    plan = artifact.plan()
    names = [n for n, _ in model.named_modules()]
    known = set(names)
    for fqn in plan:
        if fqn not in known:
            best = close_matches(fqn, names, n=1)
            hint = f" Closest module: {best[0]!r}." if best else ""
            problems.append(f"modules[{fqn!r}]: not a module of this model.{hint}")
    if plan.mesh_shape is None:
        problems.append(
            "mesh: the artifact has no mesh sizes, so shapes cannot be checked. Re-freeze it."
        )
    if problems:
        return problems
    try:
        restore_model_metadata(plan, model)
        lint_plan(model, plan.modules, MeshSpec(plan.mesh_axis_names, plan.mesh_shape or ()))
    except ValueError as e:  # PlanningError and friends
        problems.append(f"{type(e).__name__}: {e}")
    return problems
