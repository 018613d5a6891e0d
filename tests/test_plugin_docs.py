"""docs/plugins.md documents every hook (signature + register callback) and its example runs.

The hooks and their callbacks come from the registry kinds' rows (``REGISTRY_KINDS``), so a
kind without a row, a hook without a row, or a row whose hook is undocumented fails here.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from hp_core import hookspecs
from hp_core.plugins import (
    INNER_WRAPPER_REGISTRY,
    KIND_SPECS,
    REGISTRY_KINDS,
    RegistryKind,
    plugin_report,
)

DOC = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"
HOOKS = sorted(
    name
    for name, obj in vars(hookspecs).items()
    if inspect.isfunction(obj) and hasattr(obj, f"{hookspecs.PROJECT_NAME}_spec")
)
ROWS = {spec.hook_name: spec for spec in REGISTRY_KINDS}


pytestmark = pytest.mark.usefixtures("plugin_env")


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_the_hookspecs_are_the_register_hooks():
    assert HOOKS == [
        "hp_register_compute_factories",
        "hp_register_inner_wrappers",
        "hp_register_router_adapters",
        "hp_register_templates",
        "hp_register_training_adapters",
    ]


def test_every_kind_has_one_row_and_every_hook_a_kind():
    assert set(KIND_SPECS) == set(RegistryKind)
    assert [spec.kind for spec in REGISTRY_KINDS] == list(RegistryKind)  # registry order
    assert sorted(ROWS) == HOOKS


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented_with_its_signature_and_callback(hook):
    doc = DOC.read_text()
    spec = getattr(hookspecs, hook)
    params = ", ".join(inspect.signature(spec).parameters)
    assert f"### `{hook}({params})`" in doc, f"docs/plugins.md has no section for {hook}"
    callback = re.search(r"Callback: ``(register\(.*?\))``", spec.__doc__, re.DOTALL)
    assert callback, f"the docstring of {hook} does not state its register callback"
    derived = ROWS[hook].callback_text()
    assert _squash(callback.group(1)) == derived, f"the docstring of {hook} disagrees with its row"
    assert f"`{derived}`" in _squash(doc), f"callback of {hook} undocumented"
    assert f"| `{hook}({params})` | `{derived}` | `{ROWS[hook].registry}` |" in doc


def test_worked_example_runs_and_registers_with_provenance():
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.MULTILINE | re.DOTALL)
    assert len(blocks) >= 2
    namespace: dict = {"__name__": "docs_plugins_example"}
    exec(compile(blocks[0], "docs/plugins.md[worked example]", "exec"), namespace)
    assert namespace["info"].items == 4
    # the example resets at its end: its plugin is gone again
    assert "mymodels" not in [row.name for row in plugin_report()]
    assert "mymodels_ring" not in INNER_WRAPPER_REGISTRY
    for i, block in enumerate(blocks[1:], start=1):
        exec(compile(block, f"docs/plugins.md[block {i}]", "exec"), dict(namespace))


def test_the_plugin_api_version_is_documented():
    doc = DOC.read_text()
    assert "### The plugin API version" in doc
    assert f"HP_PLUGIN_API = {hookspecs.PLUGIN_API_VERSION}" in doc
