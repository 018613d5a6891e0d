"""What a refusal of a model must say: the user's module, the reason in their terms, a fix.

:func:`refusal_problems` is the one check the differential matrix, the zoo and the tests of
refusals apply to every refusal they meet. A refusal

* names a module or parameter of the user's model (its FQN, as ``named_modules()`` /
  ``named_parameters()`` spell it);
* never names hp's own bookkeeping: the facts the planner derives onto a spec
  (``Derived``'s fields, e.g. ``fused_layouts`` or ``tp_local_attr_plan``, with or without
  their leading underscore) are words of hp's code, not of the user's;
* names a contract field (``in_src``, ``out_dst``, ...) only with a fix: either the fix hp
  verified (:data:`~hp_core.verifier.advice.VERIFIED`) or a ``Fix:`` that says what to do;
* ends with a fix hp checked, or says that it found none (a reason the user can act on).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from hp_core.plans.spec_codec import USER_FIELDS
from hp_core.spec.derived import Derived
from hp_core.verifier.advice import NO_FIX, VERIFIED

__all__ = ["INTERNAL_WORDS", "refusal_problems"]

#: Names of hp's derived facts: a refusal that shows one speaks hp's language, not the user's.
INTERNAL_WORDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Derived))
_FIX = re.compile(r"(^|[\s.;])Fix: \S")


def _mentions(message: str, word: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(word)}(?![A-Za-z0-9_])", message) is not None


def refusal_problems(message: str, module_names: Iterable[str]) -> list[str]:
    """What keeps ``message`` (a refusal of the model whose modules — or parameters — are
    ``module_names``)
    from naming the user's code, the reason in their terms, and a fix; empty when it does."""
    problems = []
    reason = message.split(VERIFIED, 1)[0]
    if not any(name and name in reason for name in module_names):
        problems.append("it names no module of the model")
    internal = [w for w in INTERNAL_WORDS if _mentions(reason, w) or _mentions(reason, f"_{w}")]
    if internal:
        problems.append(f"it names hp's internal field(s) {internal}")
    fields = [f for f in USER_FIELDS if _mentions(reason, f)]
    has_fix = VERIFIED in message or _FIX.search(message) is not None
    if fields and not has_fix:
        problems.append(f"it names contract field(s) {fields} with no fix")
    if not has_fix and NO_FIX not in message:
        problems.append("it neither prints a fix nor says why hp has none")
    return problems
