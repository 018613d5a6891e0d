"""``ShardingPlan``: the contracts of every boundary of one model for one mesh (plain data).

A plan maps module FQNs (in model order) to their :class:`ModuleShardingSpec` plus the
mesh it was made for, and has a fingerprint that every rank compares before apply.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import ItemsView, Iterable, Iterator, Mapping
from typing import Any

from hp_core.plans.errors import PlanError
from hp_core.plans.example import ExampleCall
from hp_core.plans.explain import explain as explain_plan
from hp_core.plans.planning_call import PlanningCall
from hp_core.plans.spec_codec import is_int, parse_bool, plan_data, tname
from hp_core.plugins import RecordedProvider
from hp_core.spec.keywords import did_you_mean, keyword_checked
from hp_core.spec.module_spec import ModuleShardingSpec, copy_spec

__all__ = ["ShardingPlan", "check_axis_names", "check_shape"]


def check_axis_names(raw: Any, path: str, err: type[PlanError]) -> tuple[str, ...]:
    """Unique, non-empty mesh axis names as plain strings, or ``err`` naming ``path``."""
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Iterable):
        raise err(f"{path}: expected a list of mesh axis names such as [tp, cp], got {raw!r}.")
    names = tuple(raw)
    for i, n in enumerate(names):
        if not isinstance(n, str) or not n.strip():
            raise err(f"{path}[{i}]: expected a non-empty axis name, got {n!r}.")
    out = tuple(str(n) for n in names)  # MeshAxisName → plain str
    dupes = sorted({n for n in out if out.count(n) > 1})
    if dupes:
        raise err(
            f"{path}: axis names must be unique, {dupes} appear more than once in {list(out)}."
        )
    return out


def check_shape(
    raw: Any, names: tuple[str, ...], path: str, err: type[PlanError]
) -> tuple[int, ...] | None:
    """One positive size per axis name (or None when unknown), or ``err`` naming ``path``."""
    if raw is None:
        return None
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Iterable):
        raise err(f"{path}: expected a list of positive axis sizes such as [4, 2], got {raw!r}.")
    shape = tuple(raw)
    for i, n in enumerate(shape):
        if not is_int(n) or n < 1:
            raise err(f"{path}[{i}]: expected a positive integer axis size, got {n!r}.")
    if len(shape) != len(names):
        raise err(
            f"{path}: {len(shape)} size(s) {list(shape)} for {len(names)} axis name(s) "
            f"{list(names)}; give one size per axis, in the same order."
        )
    return tuple(int(n) for n in shape)


@keyword_checked
@dataclasses.dataclass
class ShardingPlan:
    """The contracts of every boundary of one model for one mesh (plain data).

    ``modules`` maps module FQNs, in model order, to their spec; ``mesh_shape`` is None
    when only the axis names are known. ``notes`` records what merging overrides dropped;
    it takes part in neither equality nor the fingerprint. ``providers`` records, per
    registry item the plan names (``"inner_wrapper.sdpa_hf"``), the distribution that
    provided it where the plan was written (:mod:`hp_core.plans.providers`); it takes part
    in neither either. ``example`` is the training call the user gave the planner
    (:mod:`hp_core.plans.example`), which the verifier runs too; None: hp's default call. It
    changes what is checked, not what runs, so it takes no part in equality or the
    fingerprint. ``planned_with`` is what the ``plan()`` call that made it was given (the
    user's overrides and flags), so a refusal's proposed fix can be re-planned and checked
    (:mod:`hp_core.plans.proposal`); None for a plan written or loaded by hand. (The
    planner's ``plan()`` passes its own defaults, e.g. ``sequence_parallel=True``.)
    """

    modules: dict[str, ModuleShardingSpec]
    mesh_axis_names: tuple[str, ...]
    mesh_shape: tuple[int, ...] | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False
    ep_size: int = 1
    notes: list[str] = dataclasses.field(default_factory=list, compare=False)
    providers: dict[str, RecordedProvider] = dataclasses.field(default_factory=dict, compare=False)
    example: ExampleCall | None = dataclasses.field(default=None, compare=False)
    planned_with: PlanningCall | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        cls = "ShardingPlan"
        if not isinstance(self.modules, Mapping):
            raise PlanError(
                f"{cls}.modules: expected a dict of module FQN to ModuleShardingSpec, got "
                f"{self.modules!r}."
            )
        modules: dict[str, ModuleShardingSpec] = {}
        for fqn, spec in self.modules.items():
            if not isinstance(fqn, str):
                raise PlanError(f"{cls}.modules: keys must be module FQN strings, got {fqn!r}.")
            if not isinstance(spec, ModuleShardingSpec):
                raise PlanError(
                    f"{cls}.modules[{fqn!r}]: expected a ModuleShardingSpec, got {tname(spec)} "
                    f"{spec!r}."
                )
            modules[fqn] = spec
        self.modules = modules
        self.mesh_axis_names = check_axis_names(
            self.mesh_axis_names, f"{cls}.mesh_axis_names", PlanError
        )
        self.mesh_shape = check_shape(
            self.mesh_shape, self.mesh_axis_names, f"{cls}.mesh_shape", PlanError
        )
        for name in ("sequence_parallel", "loss_parallel"):
            parse_bool(getattr(self, name), f"{cls}.{name}", PlanError, optional=False)
        if not is_int(self.ep_size) or self.ep_size < 1:
            raise PlanError(f"{cls}.ep_size: expected a positive integer, got {self.ep_size!r}.")
        if not isinstance(self.notes, (list, tuple)) or not all(
            isinstance(n, str) for n in self.notes
        ):
            raise PlanError(f"{cls}.notes: expected a list of strings, got {self.notes!r}.")
        self.notes = list(self.notes)
        if not isinstance(self.providers, Mapping) or not all(
            isinstance(k, str) and isinstance(v, RecordedProvider)
            for k, v in self.providers.items()
        ):
            raise PlanError(
                f"{cls}.providers: expected a dict of item key ('inner_wrapper.NAME') to "
                f"RecordedProvider, got {self.providers!r}."
            )
        self.providers = dict(self.providers)
        if self.example is not None and not isinstance(self.example, ExampleCall):
            raise PlanError(
                f"{cls}.example: expected an ExampleCall or None, got {tname(self.example)}; "
                "record a call with hp_core.plans.example.example_call(inputs)."
            )
        if self.planned_with is not None and not isinstance(self.planned_with, PlanningCall):
            raise PlanError(
                f"{cls}.planned_with: expected a PlanningCall or None, got "
                f"{tname(self.planned_with)}; leave it out (hp_core.plan() records it)."
            )

    # Mapping-like access by module FQN ------------------------------------
    def __getitem__(self, fqn: str) -> ModuleShardingSpec:
        try:
            return self.modules[fqn]
        except KeyError:
            raise KeyError(
                f"{fqn!r} is not in the plan.{did_you_mean(fqn, self.modules)}"
            ) from None

    def __contains__(self, fqn: object) -> bool:
        return fqn in self.modules

    def __iter__(self) -> Iterator[str]:
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)

    def items(self) -> ItemsView[str, ModuleShardingSpec]:
        """``(fqn, spec)`` pairs in model order."""
        return self.modules.items()

    def boundaries(self) -> dict[str, ModuleShardingSpec]:
        """The specs that wrap forward (``is_boundary``), in model order."""
        return {fqn: spec for fqn, spec in self.modules.items() if spec.is_boundary}

    def fingerprint(self) -> str:
        """SHA-256 hex of everything that affects execution; ranks compare it before apply.

        Order-sensitive (module and parameter order drive the order of collectives at
        apply time). Injected callables count by ``module.qualname``; notes and the
        runtime ``_resolved_*`` fields do not count.
        """
        data = plan_data(self, strict=False)
        text = json.dumps(
            data, sort_keys=False, separators=(",", ":"), ensure_ascii=True, default=repr
        )
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def explain(self, report: Any = None) -> str:
        """Plain text: per boundary its params, entry/exit collectives, injections and
        attribute changes, then the predicted collectives per training step (exact for the
        gradient reductions when given the verifier's ``report``)."""
        return explain_plan(self, report)

    def copy(self) -> ShardingPlan:
        """A copy whose specs can be mutated without touching this plan."""
        return ShardingPlan(
            modules={fqn: copy_spec(spec) for fqn, spec in self.modules.items()},
            mesh_axis_names=self.mesh_axis_names,
            mesh_shape=self.mesh_shape,
            sequence_parallel=self.sequence_parallel,
            loss_parallel=self.loss_parallel,
            ep_size=self.ep_size,
            notes=list(self.notes),
            providers=dict(self.providers),
            example=self.example,
            planned_with=self.planned_with,
        )
