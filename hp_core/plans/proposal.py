"""Fixes a refusal proposes, and the planning call they are checked against.

A refusal does not print its fix directly: it attaches :class:`Proposal`\\ s to the error
(:func:`propose`), and hp's public ``plan()`` / ``verify()`` re-plan the model with each
proposal added to what the user gave and verify the result before printing the first one
that holds (:mod:`hp_core.verifier.advice`). A fix that would not verify is never printed.

What a fix is checked against — the ``plan()`` call that made a plan — is
:class:`~hp_core.plans.planning_call.PlanningCall`.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import yaml

from hp_core.errors import HpError
from hp_core.plans.overrides import OverrideEntry, load_overrides, overrides_to_list

__all__ = ["Proposal", "entries_text", "proposals_of", "propose", "yaml_proposal"]

E = TypeVar("E", bound=HpError)


@dataclasses.dataclass(frozen=True)
class Proposal:
    """One fix: override entries to add, and/or ``plan()`` flags to change.

    ``text`` is what the message prints once hp has verified the fix (YAML to paste, or the
    argument to pass); ``what`` says in a few words what it does, for the message that
    reports a fix which did not verify.
    """

    text: str
    what: str
    overrides: tuple[OverrideEntry, ...] = ()
    flags: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def fits(self, other: Proposal) -> bool:
        """Whether this fix and ``other`` can be applied together: no flag set both ways (a
        fix that needs sequence parallelism cannot join one that turns it off)."""
        return all(self.flags[k] == v for k, v in other.flags.items() if k in self.flags)

    def plus(self, other: Proposal) -> Proposal:
        """This fix and ``other`` together (a fix that leads to a second refusal, and its fix)."""
        return Proposal(
            text=f"{self.text}\n{other.text}",
            what=f"{self.what}, then {other.what}",
            overrides=(*self.overrides, *(e for e in other.overrides if e not in self.overrides)),
            flags={**self.flags, **other.flags},
        )


def propose(error: E, *proposals: Proposal) -> E:
    """``error`` with ``proposals`` attached, in order of preference; returns ``error``."""
    error.proposals = (*proposals_of(error), *proposals)  # type: ignore[attr-defined]
    return error


def proposals_of(error: BaseException) -> tuple[Proposal, ...]:
    """The fixes attached to ``error`` (none for an error that proposes nothing)."""
    found = getattr(error, "proposals", ())
    return tuple(p for p in found if isinstance(p, Proposal))


def yaml_proposal(yaml_text: str, what: str, lead: str = "") -> Proposal:
    """A fix given as the override YAML a message prints (a list of ``- match:`` entries,
    indented as printed): what hp checks is read back from that very text, so the fix
    verified is the fix printed."""
    entries = tuple(load_overrides(textwrap.dedent(yaml_text)))
    return Proposal(text=f"{lead}{yaml_text.rstrip()}", what=what, overrides=entries)


def _flow(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16, sort_keys=False)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def entries_text(entries: Iterable[OverrideEntry]) -> str:
    """Override entries as the YAML a message prints: one ``- match:`` item per entry, each
    field on a line of its own in flow style, indented to paste under ``overrides:``."""
    lines = []
    for row in overrides_to_list(list(entries)):
        lines.append(f"  - match: {row.pop('match')!r}")
        lines += [f"    {key}: {_flow(value)}" for key, value in row.items()]
    return "\n".join(lines) + "\n"
