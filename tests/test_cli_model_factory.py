"""``hp plan --model pkg.mod:factory``: a zero-arg callable of the user's, imported from the
current directory like ``python -m`` and called under ``torch.device("meta")``.

A hand-written model (not transformers) planned through the CLI prints exactly what
``hp_core.plan(...).explain()`` gives; every bad factory is one usage line (exit 2) naming
the string and the fix.
"""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

from hp_core import cli, plan
from hp_core.cli.model_factory import is_factory_path
from hp_core.testing.external_models import TitanTransformer
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("builtin_only")

_ids = itertools.count()

FACTORIES = """
import torch
from hp_core.testing.external_models import TitanTransformer

SEEN = []
NOT_CALLABLE = 3


def build():
    SEEN.append(torch.empty(1).device.type)
    return TitanTransformer()


def real():
    with torch.device("cpu"):  # ignores the meta device: slower, still planned
        return TitanTransformer()


def boom():
    raise RuntimeError("no weights\\nin this sandbox")


def not_a_model():
    return {"weights": 1}


def needs_args(size):
    return TitanTransformer()
"""


@pytest.fixture
def factories(tmp_path, monkeypatch) -> str:
    """A fresh factory module in a temp folder that is the current directory; its name."""
    name = f"hp_user_factories_{next(_ids)}"
    (tmp_path / f"{name}.py").write_text(FACTORIES)
    (tmp_path / "hp_broken_factory.py").write_text("import hp_no_such_dependency_xyz\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield name
    sys.modules.pop(name, None)
    sys.modules.pop("hp_broken_factory", None)


def _plan(capsys, model: str, *extra: str) -> tuple[int, str, str]:
    code = cli.main(["plan", "--model", model, "--mesh", "tp=2", *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_hand_written_model_plans_exactly_like_the_library(capsys, factories):
    code, out, err = _plan(capsys, f"{factories}:build")
    assert (code, err) == (0, "")
    with torch.device("meta"):
        expected = plan(TitanTransformer(), "tp=2").explain()
    assert out == expected
    assert sys.modules[factories].SEEN == ["meta"]  # called under torch.device("meta")


def test_a_factory_that_builds_real_weights_still_plans(capsys, factories):
    code, out, err = _plan(capsys, f"{factories}:real")
    assert (code, err) == (0, "")
    assert out.startswith("hp plan: mesh tp=2 (2 devices)")


def test_the_current_directory_is_importable(capsys, factories, tmp_path, monkeypatch):
    """Negative control for the cwd rule: from another folder the same module is not found."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert f"No module named {factories!r}" in _usage(capsys, f"{factories}:build")
    monkeypatch.chdir(tmp_path)
    code, _, err = _plan(capsys, f"{factories}:build")
    assert (code, err) == (0, "")


def _usage(capsys, model: str) -> str:
    code, out, err = _plan(capsys, model)
    assert (code, out) == (2, ""), (code, out[:200])
    assert err.startswith(f"hp plan: error: --model {model!r}: "), err
    assert err.count("\n") == 1 and "Fix:" in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("model", [":build", "mod:", "mod:1x", "a..b:build", "mod:build:x"])
def test_not_a_module_callable_path(capsys, factories, model):
    assert "not a module:callable path" in _usage(capsys, model)


def test_an_import_failure_shows_the_import_error(capsys, factories):
    err = _usage(capsys, "hp_broken_factory:build")
    assert "cannot import 'hp_broken_factory'" in err
    assert "ModuleNotFoundError: No module named 'hp_no_such_dependency_xyz'" in err


def test_a_missing_module_says_where_to_run(capsys, factories):
    err = _usage(capsys, "hp_nowhere_module_xyz:build")
    assert "No module named 'hp_nowhere_module_xyz'" in err and "PYTHONPATH" in err


def test_a_missing_attribute_suggests_the_close_name(capsys, factories):
    err = _usage(capsys, f"{factories}:biuld")
    assert f"{factories!r} has no attribute 'biuld'. Did you mean 'build'?" in err


def test_not_callable(capsys, factories):
    assert "'NOT_CALLABLE' is a int, not a callable" in _usage(capsys, f"{factories}:NOT_CALLABLE")


@pytest.mark.parametrize(
    ("attr", "shown"),
    [
        ("boom", "calling boom() raised RuntimeError: no weights in this sandbox"),
        ("needs_args", "calling needs_args() raised TypeError:"),
    ],
)
def test_a_factory_that_raises_is_one_line(capsys, factories, attr, shown):
    assert shown in _usage(capsys, f"{factories}:{attr}")


def test_a_factory_returning_a_non_module(capsys, factories):
    err = _usage(capsys, f"{factories}:not_a_model")
    assert "not_a_model() returned dict, not a torch.nn.Module" in err


def test_paths_and_presets_are_not_factories():
    assert is_factory_path("pkg.mod:build")
    for model in ("llama-tiny", "C:\\configs\\config.json", "configs/a:b/config.json", "x:y.json"):
        assert not is_factory_path(model), model


def test_an_existing_config_path_with_a_colon_is_read_as_a_config(capsys, tmp_path, monkeypatch):
    """A file named like a factory that exists is still the config it is."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg:v1").write_text("{}")
    code, out, err = _plan(capsys, "cfg:v1")
    assert (code, out) == (2, "")
    assert "has no 'model_type'" in err
