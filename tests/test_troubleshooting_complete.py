"""Every public HpError subclass of hp_core and the bundled plugins is listed in
docs/troubleshooting.md."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import hp_core
import hp_plugin_cp
import hp_plugin_moe

DOC = Path(__file__).resolve().parent.parent / "docs" / "troubleshooting.md"


def _import_all() -> list[str]:
    failed = []
    for package in (hp_core, hp_plugin_cp, hp_plugin_moe):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            try:
                importlib.import_module(info.name)
            except (
                ImportError
            ):  # an optional extra that is not installed (hp_core.testing needs transformers)
                failed.append(info.name)
    return failed


def hp_error_classes() -> list[type]:
    _import_all()
    seen: dict[type, None] = {}
    stack = [hp_core.HpError]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in seen:
                seen[sub] = None
                stack.append(sub)
    public = []
    for cls in seen:
        if cls.__name__.startswith("_"):
            continue
        module = importlib.import_module(cls.__module__)
        if getattr(module, cls.__name__, None) is not cls:
            continue
        public.append(cls)
    return sorted(public, key=lambda c: (c.__module__, c.__name__))


def test_the_walk_finds_the_known_classes():
    names = {c.__name__ for c in hp_error_classes()}
    assert {
        "PlacementSyntaxError",
        "PreflightError",
        "ArtifactSignatureError",
        "CPConfigError",
        "MoEConfigError",
    } <= names
    assert {
        "InputLimitError",
        "PlanYAMLInputLimitError",
        "ReportFormatInputLimitError",
        "ArtifactLimitError",
    } <= names
    assert len(names) >= 60, sorted(names)


def test_every_hp_error_is_documented():
    text = DOC.read_text()
    documented = set(re.findall(r"`(\w+Error)`", text))
    missing = [
        f"{c.__module__}.{c.__name__}" for c in hp_error_classes() if c.__name__ not in documented
    ]
    assert not missing, f"add these to {DOC.name} (| error | typical cause | fix |): {missing}"
