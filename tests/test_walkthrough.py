"""docs/walkthrough.md runs, block by block, in a temporary directory.

A block fenced ```` ```python file=PATH ```` (or ``toml file=PATH``) is written to ``PATH``;
a plain ```` ```python ```` block runs in one namespace shared by the page; a
```` ```console ```` block's ``$ command`` lines run in bash and must exit 0. The page
installs its plugin with pip into a folder of the temporary directory (never into the
environment) and spawns its own gloo worlds, so it runs here and not in test_docs.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hp_core.plugins import reset_plugins

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "walkthrough.md"
_BLOCK = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(text: str) -> list[tuple[str, str, str]]:
    """``(language, info, body)`` of every fenced block, in page order."""
    return [(lang, info.strip(), body) for lang, info, body in _BLOCK.findall(text)]


def _env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    tests = work / "hp-plugin-tinygpt" / "tests"  # where the page's factories live
    paths = [str(work / "site"), str(work), str(tests), *sys.path]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def test_every_block_of_the_walkthrough_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    for name in ("HP_PLUGINS", "HP_DISABLE_PLUGIN_AUTOLOAD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace: dict = {"__name__": "docs_walkthrough"}
    ran = {"file": 0, "python": 0, "console": 0}
    try:
        for i, (lang, info, body) in enumerate(blocks(PAGE.read_text())):
            target = re.search(r"file=(\S+)", info)
            if target:
                path = tmp_path / target.group(1)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(body)
                ran["file"] += 1
            elif lang == "python":
                exec(compile(body, f"walkthrough.md[block {i}]", "exec"), namespace)
                ran["python"] += 1
            elif lang == "console":
                for line in body.splitlines():
                    if not line.startswith("$ "):
                        continue
                    done = subprocess.run(
                        ["bash", "-c", line[2:]],
                        cwd=tmp_path,
                        env=_env(tmp_path),
                        capture_output=True,
                        text=True,
                        timeout=300,
                    )
                    assert done.returncode == 0, (line, done.stdout[-3000:], done.stderr[-3000:])
                    ran["console"] += 1
    finally:
        reset_plugins()
    assert ran["file"] >= 3 and ran["python"] >= 3 and ran["console"] >= 2, ran


def test_blocks_reads_info_strings() -> None:
    text = "```python file=a/b.py\nx = 1\n```\n\n```console\n$ true\n```\n"
    assert blocks(text) == [("python", "file=a/b.py", "x = 1\n"), ("console", "", "$ true\n")]
