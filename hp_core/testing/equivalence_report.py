"""What one equivalence check found: the report, its failure message and the input errors.

A check compares quantities (``loss``, ``logits``, ``grad``, ``param``, ``moved``) of each
mode (``production``, ``validate``, and ``production-validate``, the two modes against each
other) with the single-device reference. Each quantity keeps its worst tensors; a quantity
fails when its worst excess (see :func:`hp_core.testing.compare.allclose_excess`) is above
``atol`` or not finite.
"""

from __future__ import annotations

import dataclasses
import math

from hp_core.errors import HpError

__all__ = [
    "EquivalenceArgumentError",
    "EquivalenceBatchError",
    "EquivalenceError",
    "EquivalenceFactoryError",
    "EquivalenceInputError",
    "EquivalenceMeshError",
    "EquivalenceOutputError",
    "EquivalenceReport",
    "EquivalenceRunError",
    "Finding",
]

#: How many tensors behind the worst one a failure message names.
RUNNERS_UP = 4


class EquivalenceInputError(HpError, ValueError):
    """An argument of ``check_equivalence`` that cannot be used (the base of the input errors)."""


class EquivalenceFactoryError(EquivalenceInputError, ImportError):
    """A model or batch factory that does not import, is not callable or cannot reach the ranks."""


class EquivalenceBatchError(EquivalenceInputError, TypeError):
    """A batch factory whose result is not a mapping of model keyword arguments with a tensor."""


class EquivalenceOutputError(EquivalenceInputError, TypeError):
    """A model output with no ``.loss`` (and no ``loss_fn`` given), or a loss that is no scalar."""


class EquivalenceMeshError(EquivalenceInputError):
    """A mesh whose number of ranks is not the world's size."""


class EquivalenceArgumentError(EquivalenceInputError):
    """A ``steps`` below 1, or ``modes`` empty or naming an unknown mode."""


class EquivalenceRunError(HpError, RuntimeError):
    """A model raised while the check ran it: names which copy (the reference or a mode),
    the step and the phase (forward with the loss, or backward); the rank's traceback is
    the cause."""


@dataclasses.dataclass(frozen=True)
class Finding:
    """One compared tensor: its name, the step, its worst excess and its plan placements."""

    name: str
    step: int
    excess: float
    placements: str

    def text(self) -> str:
        return f"{self.name} [{self.placements}] at step {self.step}: excess {self.excess:.3g}"


@dataclasses.dataclass
class EquivalenceReport:
    """Per ``"mode:quantity"`` the worst excess over every step and tensor (picklable).

    ``worst`` maps ``"production:grad"`` (and so on) to a float, ``findings`` to that
    quantity's tensors, worst first; ``compared`` to how many distinct tensors it compared;
    ``problems`` to what could not be compared at all (a gradient the gatherer refused, a
    parameter that did not move), each naming the tensor.
    """

    mesh: str
    modes: tuple[str, ...]
    steps: int
    rtol: float
    atol: float
    worst: dict[str, float] = dataclasses.field(default_factory=dict)
    findings: dict[str, list[Finding]] = dataclasses.field(default_factory=dict)
    compared: dict[str, int] = dataclasses.field(default_factory=dict)
    problems: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    n_params: int = 0

    # ------------------------------------------------------------- recording

    def record(self, key: str, per_tensor: dict[str, float], step: int, layouts: dict) -> None:
        """Fold one step's per-tensor excesses of ``key`` into the report."""
        best: dict[str, Finding] = {f.name: f for f in self.findings.get(key, [])}
        for name, excess in per_tensor.items():
            old = best.get(name)
            if old is None or _worse(excess, old.excess):
                best[name] = Finding(name, step, excess, layouts.get(name, "not in the plan"))
        ranked = sorted(best.values(), key=lambda f: _sort_key(f.excess), reverse=True)
        self.findings[key] = ranked
        self.compared[key] = len(ranked)
        self.worst[key] = ranked[0].excess if ranked else 0.0

    def problem(
        self, key: str, step: int, lines: list[str], first: str, layouts: dict[str, str]
    ) -> None:
        """Something of ``key`` could not be compared: an infinite excess naming ``first``."""
        self.problems.setdefault(key, []).extend(f"step {step}: {line.strip()}" for line in lines)
        self.record(key, {first: math.inf}, step, layouts)

    # ------------------------------------------------------------- reading

    def tolerance(self) -> str:
        return f"atol={self.atol:g}, rtol={self.rtol:g} (|got - ref| <= atol + rtol*|ref|)"

    def failed(self) -> list[str]:
        """The ``mode:quantity`` keys above tolerance (or not finite), worst first."""
        bad = [k for k, v in self.worst.items() if not v <= self.atol]
        return sorted(bad, key=lambda k: _sort_key(self.worst[k]), reverse=True)

    @property
    def passed(self) -> bool:
        return not self.failed()

    def summary(self) -> str:
        """One line per mode and quantity: the worst excess and where it is."""
        lines = [f"hp equivalence check on {self.mesh}, {self.steps} step(s), {self.tolerance()}:"]
        for key in sorted(self.worst, key=_key_order):
            found = self.findings.get(key) or []
            where = found[0].text() if found else "nothing compared"
            verdict = "ok" if self.worst[key] <= self.atol else "FAILED"
            lines.append(
                f"  {key:<30} {verdict:<6} worst {self.worst[key]:.3g} over "
                f"{self.compared.get(key, 0)} tensor(s); {where}"
            )
        return "\n".join(lines)

    def failure_message(self) -> str:
        """What :class:`EquivalenceError` says: the first failure (by step, mode, quantity)
        on the first line, then each failing quantity's worst tensors and what could not be
        compared."""
        bad = sorted(self.failed(), key=self._first_step)
        if not bad:
            return "hp equivalence check passed"
        key = bad[0]
        mode, _, quantity = key.partition(":")
        head = self._head(key)
        lines = [
            f"{mode} mode, step {head.step}, {quantity}: {head.name} [{head.placements}] is off "
            f"the single-device reference by excess {head.excess:.3g} > tolerance "
            f"{self.tolerance()}.",
            f"Where: hp equivalence check on mesh {self.mesh}, modes {list(self.modes)}, "
            f"{self.steps} step(s).",
        ]
        for k in bad:
            found = [f for f in self.findings.get(k, []) if not f.excess <= self.atol]
            rest = "; ".join(f.text() for f in found[1 : 1 + RUNNERS_UP])
            lines.append(
                f"{k}: worst {self._head(k).text()}" + (f"; next worst: {rest}" if rest else "")
            )
            lines.extend(f"  {p}" for p in self.problems.get(k, [])[:6])
        lines.append(
            "Fix: inspect the named tensor's layout in the plan (hp_core.plan(...).explain()); "
            "a failure in production only points at the local-shard runtime (e.g. a fused "
            "projection split as plain rows), one in both modes at the plan's placements or "
            "the model's forward."
        )
        return "\n".join(lines)

    def _head(self, key: str) -> Finding:
        found = self.findings.get(key) or []
        return found[0] if found else Finding("?", -1, self.worst[key], "?")

    def _first_step(self, key: str) -> tuple[int, int, int]:
        mode, _, quantity = key.partition(":")
        return (self._head(key).step, _MODE_ORDER.get(mode, 9), _QUANTITY_ORDER.get(quantity, 9))


class EquivalenceError(AssertionError):
    """The parallel model is not the single-device one: names mode, step, tensor and excess."""

    def __init__(self, report: EquivalenceReport) -> None:
        self.report = report
        super().__init__(report.failure_message())

    def __reduce__(self) -> tuple[type, tuple[EquivalenceReport]]:
        return (type(self), (self.report,))


def _worse(a: float, b: float) -> bool:
    return _sort_key(a) > _sort_key(b)


def _sort_key(v: float) -> float:
    return math.inf if math.isnan(v) else v


_MODE_ORDER = {"production": 0, "validate": 1, "production-validate": 2}
_QUANTITY_ORDER = {"loss": 0, "logits": 1, "grad": 2, "param": 3, "moved": 4}


def _key_order(key: str) -> tuple[int, int, str]:
    mode, _, quantity = key.partition(":")
    return (_MODE_ORDER.get(mode, 9), _QUANTITY_ORDER.get(quantity, 9), key)
