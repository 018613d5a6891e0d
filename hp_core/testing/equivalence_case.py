"""One equivalence case of a plugin's conformance suite: what to run through the check.

An :class:`EquivalenceCase` holds the arguments of
:func:`hp_core.testing.check_equivalence` for one model and mesh, so a plugin's
conformance class (:class:`hp_core.testing.conformance.PluginConformance`) can list them
as data and the suite runs each one as its own test. :meth:`EquivalenceCase.family` makes
one for a tiny Hugging Face family of :mod:`hp_core.testing.families`, with the picklable
factories :class:`FamilyModel` and :class:`FamilyBatch`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from hp_core.errors import HpError
from hp_core.testing.families import build_family, family_batch

__all__ = ["EquivalenceCase", "EquivalenceCaseError", "FamilyBatch", "FamilyModel"]


class EquivalenceCaseError(HpError, ValueError):
    """An :class:`EquivalenceCase` built with arguments the check cannot run."""


def _mesh_text(mesh: str | Mapping[str, int]) -> str:
    if isinstance(mesh, str):
        return mesh.replace(" ", "")
    return ",".join(f"{axis}={size}" for axis, size in mesh.items())


@dataclasses.dataclass(frozen=True)
class FamilyModel:
    """A model factory: ``build_family(family, seed=seed, **config)`` (picklable by value)."""

    family: str
    seed: int = 0
    config: tuple[tuple[str, Any], ...] = ()

    def __call__(self) -> nn.Module:
        # No padding id (as family_model): its embedding row would get no gradient.
        return build_family(
            self.family, seed=self.seed, **{"pad_token_id": None, **dict(self.config)}
        )


@dataclasses.dataclass(frozen=True)
class FamilyBatch:
    """A batch factory: step ``s`` gets ``family_batch(family, seed=s)`` as ids and labels."""

    family: str
    batch: int = 2
    seq: int = 16

    def __call__(self, step: int) -> dict[str, Any]:
        ids = family_batch(self.family, batch=self.batch, seq=self.seq, seed=step)
        return {"input_ids": ids, "labels": ids, "use_cache": False}


@dataclasses.dataclass(frozen=True)
class EquivalenceCase:
    """The arguments of one ``check_equivalence`` call.

    ``model_factory`` (a zero-arg module-level callable or ``"pkg.mod:fn"``) builds the same
    seeded CPU model on every call; ``batch_factory(step)`` returns the model's keyword
    arguments for a step (or ``"pkg.mod:fn"``); both must be importable on the spawned
    ranks, so define them in a module next to the tests, not inside a test function.
    ``mesh`` is mesh text (``"tp=2"``, ``"tp=2,ep=2"``) or a mapping; ``overrides`` and
    ``plan_kwargs`` go to ``hp_core.plan``; ``modes``, ``steps``, ``loss_fn``, ``shard_batch``
    and ``after_apply`` to the check. ``name``
    is the test id (default: the mesh text); ``rtol``/``atol`` are hp's tolerance
    convention, ``|got - ref| <= atol + rtol * |ref|``.
    """

    model_factory: Callable[[], Any] | str
    batch_factory: Callable[[int], Mapping[str, Any]] | str
    mesh: str | Mapping[str, int] = "tp=2"
    overrides: Any = None
    plan_kwargs: Mapping[str, Any] | None = None
    modes: Sequence[str] = ("production", "validate")
    steps: int = 2
    name: str | None = None
    rtol: float = 1e-5
    atol: float = 1e-5
    #: ``check_equivalence``'s hooks (module-level callables, importable on the ranks): the
    #: loss of a plain-tensor output, a batch split (cp), a step after apply (cp's loss).
    loss_fn: Callable[[Any, Any], Any] | None = None
    shard_batch: Callable[[Any, Any], Any] | None = None
    after_apply: Callable[[Any, str], None] | None = None

    def __post_init__(self) -> None:
        for field in ("model_factory", "batch_factory"):
            value = getattr(self, field)
            if not (callable(value) or (isinstance(value, str) and ":" in value)):
                raise EquivalenceCaseError(
                    f"EquivalenceCase({field}={value!r}): expected a module-level callable or "
                    "an import path 'pkg.module:function'. Fix: pass the function itself (or "
                    "its 'pkg.module:function' path)."
                )
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 1:
            raise EquivalenceCaseError(
                f"EquivalenceCase(steps={self.steps!r}): the check trains at least one step. "
                "Fix: pass steps=2 (the suite's default)."
            )
        if not self.modes or any(m not in ("production", "validate") for m in self.modes):
            raise EquivalenceCaseError(
                f"EquivalenceCase(modes={tuple(self.modes)!r}): each mode is 'production' or "
                "'validate'. Fix: pass modes=('production', 'validate')."
            )

    @classmethod
    def family(
        cls, family: str, mesh: str | Mapping[str, int] = "tp=2", **fields: Any
    ) -> EquivalenceCase:
        """The case of a tiny family of :mod:`hp_core.testing.families` (e.g. ``"phi3"``);
        ``fields`` are the other fields (``plan_kwargs``, ``overrides``, ``steps``, ...);
        ``name`` defaults to ``"<family>-<mesh>"``."""
        fields.setdefault("name", f"{family}-{_mesh_text(mesh)}")
        return cls(FamilyModel(family), FamilyBatch(family), mesh, **fields)

    @property
    def id(self) -> str:
        """The test id: ``name``, else the mesh text (``tp=2``)."""
        return self.name or _mesh_text(self.mesh)

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``check_equivalence`` after the two factories."""
        return {
            "mesh": self.mesh,
            "overrides": self.overrides,
            "plan_kwargs": dict(self.plan_kwargs) if self.plan_kwargs else None,
            "modes": tuple(self.modes),
            "steps": self.steps,
            "rtol": self.rtol,
            "atol": self.atol,
            "loss_fn": self.loss_fn,
            "shard_batch": self.shard_batch,
            "after_apply": self.after_apply,
        }
