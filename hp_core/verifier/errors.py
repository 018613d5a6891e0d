"""What the verifier refuses. Each message names the module (and parameter), says what it
found, and ends with a pasteable override or the change that makes the plan right."""

from __future__ import annotations

from hp_core.errors import HpError
from hp_core.runtime.boundary import UndeclaredCommunicationError
from hp_core.runtime.partial import AmbiguousGradientError

__all__ = [
    "AmbiguousGradientError",
    "InputGradientError",
    "LayoutMismatchError",
    "MixedGradientError",
    "ProductionDiffersError",
    "RandomOnPartialError",
    "UndeclaredCommunicationError",
    "UnverifiableError",
    "VerificationError",
]


class VerificationError(HpError, ValueError):
    """The plan cannot be proven to give single-device results; refused before any collective."""


class ProductionDiffersError(VerificationError):
    """Code run on local shards (production mode, or a local region in either mode) fails
    where the unsharded model's runs, or produces another shape than validate mode."""


class LayoutMismatchError(VerificationError):
    """What arrives at (or leaves) a boundary is not in the layout its contract declares."""


class RandomOnPartialError(VerificationError):
    """A random op (dropout, ...) runs on partial sums: every rank would draw its own mask
    for a value that only exists after the reduction."""


class MixedGradientError(VerificationError):
    """One parameter gets a whole gradient in one place and a partial one in another
    (e.g. a tied weight), so no single reduction can make it right."""


class InputGradientError(VerificationError):
    """The gradient of a region's input is partial where production assumes it whole, or
    the reverse: production's backward collective would be wrong."""


class UnverifiableError(VerificationError):
    """The verifier cannot run the model (it needs inputs, or a copy of it on meta fails)."""
