"""docs/roles.md documents every ``Role`` member in its table, and no member that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

from hp_core import Role

ROLES_MD = Path(__file__).resolve().parent.parent / "docs" / "roles.md"
_ROW = re.compile(r"^\|\s*`Role\.([A-Za-z_]+)`\s*\|", re.MULTILINE)


def documented_roles(text: str) -> list[str]:
    """The ``Role.X`` names that start a row of a Markdown table in ``text``."""
    return _ROW.findall(text)


def role_doc_gaps(text: str, members: list[str]) -> tuple[list[str], list[str]]:
    """``(missing, unknown)``: members with no table row, and rows naming no member."""
    rows = documented_roles(text)
    return [m for m in members if m not in rows], [r for r in rows if r not in members]


def test_every_role_member_has_a_row_and_every_row_a_member() -> None:
    members = [m.name for m in Role]
    missing, unknown = role_doc_gaps(ROLES_MD.read_text(), members)
    assert missing == [] and unknown == [], (missing, unknown)
    assert len(documented_roles(ROLES_MD.read_text())) == len(members)  # one row each


def test_the_checker_detects_a_missing_and_an_unknown_member() -> None:
    text = ROLES_MD.read_text()
    members = [m.name for m in Role]
    assert role_doc_gaps(text, [*members, "FUSED_QKV_INTERLEAVED"]) == (
        ["FUSED_QKV_INTERLEAVED"],
        [],
    )
    without_norm = text.replace("| `Role.NORM` |", "| norm |")
    assert role_doc_gaps(without_norm, members) == (["NORM"], [])
    extra = text + "\n| `Role.MADE_UP` | x |\n"
    assert role_doc_gaps(extra, members) == ([], ["MADE_UP"])
