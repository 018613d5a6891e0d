"""The plan verifier: prove on meta-device copies that a plan gives single-device results.

``verify(model, plan, mesh)`` runs before any collective (``apply`` calls it by default)
and refuses, with a specific error that names the module and the fix, what it cannot
prove: undeclared communication inside a region, a parameter that does not fit the
activation it meets, an output layout other than the declared one, production code that
fails or shapes that differ between the modes, random ops on partial sums. It also
derives which gradients are partial sums — what ``apply`` then reduces.
"""

from __future__ import annotations

from hp_core.verifier.advice import verify
from hp_core.verifier.errors import (
    AmbiguousGradientError,
    InputGradientError,
    LayoutMismatchError,
    MixedGradientError,
    ProductionDiffersError,
    RandomOnPartialError,
    UndeclaredCommunicationError,
    UnverifiableError,
    VerificationError,
)
from hp_core.verifier.report import ReportFormatError, VerifyReport

__all__ = [
    "AmbiguousGradientError",
    "InputGradientError",
    "LayoutMismatchError",
    "MixedGradientError",
    "ProductionDiffersError",
    "RandomOnPartialError",
    "ReportFormatError",
    "UndeclaredCommunicationError",
    "UnverifiableError",
    "VerificationError",
    "VerifyReport",
    "verify",
]
