"""docs/shardable-forwards.md: every bad forward is refused or caught, every good one matches.

The doc shows the classes of ``tests/forward_examples.py`` verbatim; each runs on tp=2
through ``check_equivalence`` (both modes against one device, 2 AdamW steps).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from hp_core import HpError
from hp_core.testing import EquivalenceError, check_equivalence, get_world
from tests import forward_examples as fe

DOC = Path(__file__).resolve().parent.parent / "docs" / "shardable-forwards.md"

#: example -> the error hp raises for it (None: it matches one device).
EXPECTED = {
    "HardCodedHeads": "ProductionDiffersError",
    "LocalHeads": None,
    "UnknownHeadCount": None,
    "ResidualInside": "UndeclaredCommunicationError",
    "ResidualOutside": None,
    "RawBias": "UndeclaredCommunicationError",
    "PerHeadGrid": "UndeclaredCommunicationError",
    "PerHeadVector": None,
}


def test_the_doc_shows_every_example_verbatim_and_its_outcome() -> None:
    text = DOC.read_text()
    assert set(EXPECTED) == set(fe.EXAMPLES)
    for name, cls in fe.EXAMPLES.items():
        assert inspect.getsource(cls) in text, f"{name} differs from tests/forward_examples.py"
        outcome = EXPECTED[name] or "matches"
        assert f"`{name}`: {outcome}" in text, (name, outcome)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_example_is_refused_or_matches(name: str) -> None:
    try:
        check_equivalence(
            fe.factory(name),
            "tests.forward_examples:batch",
            "tp=2",
            loss_fn=fe.loss,
            world=get_world(2),
        )
        outcome = None
    except EquivalenceError as err:
        outcome = type(err).__name__
        assert "production" in str(err)
    except HpError as err:
        outcome = type(err).__name__
        assert "layers.0.block" in str(err)  # the refusal names the module
    assert outcome == EXPECTED[name]
