"""docs/templates.md lists every ``TemplateContext`` field; ``builtin_template`` is the core's."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import hp_core
from hp_core.planner.templates.roles import BOUNDARY_KINDS
from hp_core.plugins import TEMPLATE_REGISTRY

TEMPLATES_MD = Path(__file__).resolve().parent.parent / "docs" / "templates.md"
_ROW = re.compile(r"^\|\s*`([A-Za-z_]+)`\s*\|\s*`[^`]+`\s*\|", re.MULTILINE)


def field_doc_gaps(text: str, fields: list[str]) -> tuple[list[str], list[str]]:
    """``(missing, unknown)``: fields without a ``| `name` | `type` |`` row, rows of no field."""
    rows = _ROW.findall(text)
    return [f for f in fields if f not in rows], [r for r in rows if r not in fields]


def _fields() -> list[str]:
    return [f.name for f in dataclasses.fields(hp_core.TemplateContext)]


def test_every_template_context_field_has_a_row() -> None:
    assert field_doc_gaps(TEMPLATES_MD.read_text(), _fields()) == ([], [])


def test_the_checker_detects_a_missing_and_an_unknown_field() -> None:
    text = TEMPLATES_MD.read_text()
    assert field_doc_gaps(text, [*_fields(), "rank"]) == (["rank"], [])
    assert field_doc_gaps(text.replace("| `ep_size` |", "| ep_size |"), _fields()) == (
        ["ep_size"],
        [],
    )
    assert field_doc_gaps(text + "\n| `world` | `int` | x | 1 |\n", _fields()) == ([], ["world"])


@pytest.mark.parametrize("kind", BOUNDARY_KINDS)
def test_builtin_template_is_the_one_the_builtin_plugin_registers(kind: str) -> None:
    template = hp_core.builtin_template(kind)
    assert template.kind == kind
    item = TEMPLATE_REGISTRY[template.name]
    assert item.value is template and item.provider == "builtin"


@pytest.mark.parametrize("bad", ["atention", "", None, 3])
def test_builtin_template_refuses_an_unknown_kind(bad: object) -> None:
    with pytest.raises(hp_core.TemplateDefinitionError) as err:
        hp_core.builtin_template(bad)  # type: ignore[arg-type]
    assert repr(bad) in str(err.value) and "attention" in str(err.value)
    assert "Fix:" in str(err.value)
