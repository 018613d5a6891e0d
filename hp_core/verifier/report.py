"""What the verifier proved about one plan on one mesh (``hp_core.VerifyReport``)."""

from __future__ import annotations

import dataclasses

from hp_core.runtime.grads import GradReduction

__all__ = ["VerifyReport"]


@dataclasses.dataclass
class VerifyReport:
    """What the verifier proved about one plan on one mesh."""

    fingerprint: str
    mesh: tuple[tuple[str, int], ...]
    #: the gradients that are partial sums, and over which axes hp sums them
    reductions: tuple[GradReduction, ...]
    #: boundaries whose region DTensor propagation checked
    checked: tuple[str, ...]
    #: boundaries whose inside runs on local tensors: not looked into, and why
    opaque: dict[str, str]
    #: repeated layer → the identical one that was checked in its place
    repeated: dict[str, str]
    seconds: float = 0.0

    def partial(self) -> dict[str, tuple[str, ...]]:
        """``{parameter FQN: axes}`` of every partial gradient."""
        return {r.param: r.axes for r in self.reductions}

    def summary(self) -> str:
        lines = [
            f"verified on mesh {dict(self.mesh)} in {self.seconds:.2f} s: {len(self.checked)} boundaries checked by "
            f"propagation, {len(self.opaque)} run on local tensors, {len(self.repeated)} repeated layers skipped",
        ]
        by_axes: dict[tuple[str, ...], list[str]] = {}
        for r in self.reductions:
            by_axes.setdefault(r.axes, []).append(r.param)
        for axes, names in by_axes.items():
            lines.append(f"  partial gradients summed over {'+'.join(axes)}: {len(names)} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
        for fqn, why in list(self.opaque.items())[:8]:
            lines.append(f"  not looked into: {fqn} ({why})")
        return "\n".join(lines)
