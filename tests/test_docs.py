"""Every ```python block in README.md and docs/*.md runs; every ```yaml block parses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
#: walkthrough.md writes files, installs its plugin and spawns worlds: test_walkthrough.py runs it.
DOCS = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "walkthrough.md"),
]
_BLOCK = re.compile(r"^```(python|yaml)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks(path: Path, lang: str) -> list[str]:
    return [body for kind, body in _BLOCK.findall(path.read_text()) if kind == lang]


@pytest.mark.parametrize("path", [p for p in DOCS if _blocks(p, "python")], ids=lambda p: p.name)
def test_python_blocks_run(path, capsys):
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    for i, block in enumerate(_blocks(path, "python")):
        code = compile(block, f"{path.name}[python block {i}]", "exec")
        exec(code, namespace)


@pytest.mark.parametrize("path", [p for p in DOCS if _blocks(p, "yaml")], ids=lambda p: p.name)
def test_yaml_blocks_parse(path):
    for block in _blocks(path, "yaml"):
        assert yaml.safe_load(block) is not None
