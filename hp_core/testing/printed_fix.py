"""Read back the fix a refusal printed, as a user pasting it would.

hp prints a fix only after planning the model with it and verifying the plan
(:mod:`hp_core.verifier.advice`), under the line :data:`~hp_core.verifier.advice.VERIFIED`:
override entries as indented ``- match:`` YAML, and possibly a line turning sequence
parallelism off. :func:`printed_fix` returns both, so a test can follow the fix and check
that the model then matches one device.
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

import yaml

from hp_core.verifier.advice import SP_OFF, VERIFIED

__all__ = ["PrintedFix", "printed_fix"]


@dataclasses.dataclass(frozen=True)
class PrintedFix:
    """The override entries (plain YAML data) and ``plan()`` flags of one printed fix."""

    overrides: list[dict[str, Any]]
    flags: dict[str, Any]


def printed_fix(message: str) -> PrintedFix | None:
    """The verified fix ``message`` prints, or None when it prints none."""
    start = message.rfind(VERIFIED)
    if start < 0:
        return None
    entries: list[str] = []
    flags: dict[str, Any] = {}
    for line in message[start + len(VERIFIED) :].splitlines()[1:]:
        if line.startswith("  "):
            entries.append(line)
        elif line.removeprefix("and ") == SP_OFF:
            flags["sequence_parallel"] = False
        else:
            break
    parsed = yaml.safe_load(textwrap.dedent("\n".join(entries))) if entries else []
    if not isinstance(parsed, list) or not all(isinstance(e, dict) for e in parsed):
        raise ValueError(f"the printed fix is not a list of override entries:\n{message}")
    return PrintedFix(overrides=parsed, flags=flags)
