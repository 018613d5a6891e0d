"""docs/ep.md: its YAML blocks turn EP on for real (two gloo ranks, compared with single device)."""

from __future__ import annotations

import re
from pathlib import Path

import moe_tasks as tasks
import pytest
import yaml

from hp_core.testing import get_world

pytestmark = pytest.mark.distributed
DOC = Path(__file__).resolve().parents[2] / "docs" / "ep.md"


def _yaml_blocks() -> list[str]:
    return re.findall(r"^```yaml\n(.*?)^```", DOC.read_text(), flags=re.MULTILINE | re.DOTALL)


def _block_for(factory: str) -> str:
    (text,) = [b for b in _yaml_blocks() if factory in b]
    return text


@pytest.mark.parametrize("family", ["qwen2moe", "mixtral"])
def test_the_documented_yaml_turns_ep_on(family):
    text = _block_for(family)
    entry = yaml.safe_load(text)["overrides"][0]
    assert entry["when"] == "ep" and entry["region_dispatch"] is False
    for r in get_world(2).run(tasks.yaml_compare, family, text, (2,), ("tp",), ep=2):
        bad = {k: v for k, v in r.items() if ":" in k and not v <= 1e-5}  # NaN-safe: NaN is bad
        assert not bad, bad
        assert not any(r["not_stepped"].values()), r["not_stepped"]  # the step moved every weight
        assert r["local_expert_shape"][0] == 2 and r["n_expert_grads"] == 4


def test_the_documented_non_sp_fix_is_the_one_preflight_prints():
    (text,) = [b for b in _yaml_blocks() if "in_dst" in b]
    documented = yaml.safe_load(text)["overrides"]
    message = get_world(2).run(tasks.apply_error, "replicated_tokens")[0]["message"]
    assert yaml.safe_load(message.split("with an override:\n", 1)[1]) == documented
