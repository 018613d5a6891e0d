"""``hp plan --model PATH --mesh tp=2`` for every family of the differential matrix (issue 14,
item 11).

Each family's tiny config is written with ``config.save_pretrained`` and planned by the CLI
in-process, given the folder (and, for a sample, the ``config.json`` itself). A family the planner
takes prints exactly the plan ``hp_core.plan`` derives for the same meta model, with its
predicted collectives per training step; a family it refuses exits 1 with one
``hp plan: error: TypeError: ...`` message naming a module of the model (no traceback,
nothing on stdout), the same refusal as ``hp_core.plan``. A family that matches a single
device unaided in the matrix must plan here.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from hp_core import HpError, cli
from hp_core.planner.plan import plan as raw_plan
from hp_core.testing.families import build_family, tiny_family_config
from hp_core.testing.family_matrix import FAMILY_NAMES
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)
from tests.test_matrix import EXPECTED, TAUGHT_BY_PLUGIN, UNAIDED

pytestmark = pytest.mark.usefixtures("builtin_only")

MESH = "tp=2"


@functools.cache
def _library(name: str) -> tuple[str, str | None, tuple[str, ...]]:
    """``(explain text or "", refusal type or None, module names)`` from the planner (without
    the checked-fix search ``hp_core.plan`` adds to a refusal's message: the CLI runs that,
    and neither the plan nor the refusal's type depends on it)."""
    model = build_family(name, device="meta")
    names = tuple(n for n, _ in model.named_modules() if n)
    try:
        return raw_plan(model, MESH).explain(), None, names
    except HpError as e:
        return "", type(e).__name__, names


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Every family's tiny config, saved by ``save_pretrained`` in its own folder."""
    root = tmp_path_factory.mktemp("configs")
    folders = {}
    for name in FAMILY_NAMES:
        tiny_family_config(name).save_pretrained(root / name)
        folders[name] = root / name
    return folders


def _cli(capsys, target: Path) -> tuple[int, str, str]:
    code = cli.main(["plan", "--model", str(target), "--mesh", MESH])
    out, err = capsys.readouterr()
    return code, out, err


#: The ``config.json`` form differs from the folder form in how the path is read only: a
#: sample of both branches (plans, refused, taught by a plugin; dense, MoE, MLA, recurrent)
#: rather than every family again.
AS_FILE = ["llama", "gpt2", "bloom", "doge", "mixtral", "deepseek_v3", "mamba", "cpmant"]
CASES = [(n, False) for n in FAMILY_NAMES] + [(n, True) for n in AS_FILE]


@pytest.mark.parametrize(
    ("name", "as_file"), CASES, ids=[f"{n}-{'config.json' if f else 'folder'}" for n, f in CASES]
)
def test_hp_plan_prints_the_plan_or_refuses_clearly(capsys, saved, name, as_file):
    target = saved[name] / "config.json" if as_file else saved[name]
    code, out, err = _cli(capsys, target)
    explained, refusal, modules = _library(name)
    if refusal is None:
        assert (code, err) == (0, ""), err
        assert out == explained  # the CLI plans what the library plans
        assert out.startswith(f"hp plan: mesh {MESH} (2 devices); sequence parallel on")
        assert re.search(r"^\d+ modules planned \(\d+ boundaries\)", out, flags=re.M)
        assert "collectives per training step (predicted, one forward + one backward):" in out
        assert re.search(r"^  forward: [1-9]\d*\n", out, flags=re.M), out[-600:]
        return
    # Only the built-in plugin is loaded here: a family a plugin teaches is the core's refusal.
    assert EXPECTED[name] != UNAIDED or name in TAUGHT_BY_PLUGIN, (
        f"{name} matches unaided in the matrix, but hp plan refuses"
    )
    assert (code, out) == (1, ""), (code, out[:300])
    assert err.startswith(f"hp plan: error: {refusal}: "), err[:300]
    assert "Traceback" not in err
    assert any(m in err for m in modules), f"the refusal names no module of {name}: {err[:300]}"


def test_every_family_that_matches_unaided_plans_and_some_are_refused():
    """The split above is not vacuous: both branches are taken."""
    refused = {n for n in FAMILY_NAMES if _library(n)[1] is not None}
    assert refused and len(refused) < len(FAMILY_NAMES)
    assert {n for n in refused if EXPECTED[n] == UNAIDED} == set(TAUGHT_BY_PLUGIN)


def test_a_config_folder_without_config_json_is_a_usage_error(capsys, tmp_path):
    """Negative control: the folder form really reads ``config.json`` from the folder."""
    code, out, err = _cli(capsys, tmp_path)
    assert (code, out) == (2, "")
    assert err.startswith(f"hp plan: error: --model: '{tmp_path / 'config.json'}': no such file.")
