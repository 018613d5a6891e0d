"""The facts of docs/injection-contracts.md, observed on real gloo ranks (tests/dist_tasks_docs.py).

An inner wrapper is called at apply time with the target's parameters already sharded, and
its replacement receives DTensors exactly in validate mode with ``region_dispatch: true``;
the verifier's meta copies call a dispatching wrapper too. A compute factory is called at
apply time with the experts whole; its compute sees this rank's experts.
"""

from __future__ import annotations

import pytest

from hp_core.testing import get_world
from tests import dist_tasks_docs as tasks


def _real(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["device"] == "cpu"]


@pytest.mark.parametrize(
    ("mode", "dispatch", "wrap_kind", "call_kind"),
    [
        ("production", True, "Parameter", "Parameter"),
        ("production", False, "Parameter", "Parameter"),
        ("validate", True, "DTensor", "DTensor"),
        ("validate", False, "DTensor", "Tensor"),
    ],
)
def test_what_an_inner_wrapper_receives(
    mode: str, dispatch: bool, wrap_kind: str, call_kind: str
) -> None:
    rows = get_world(2).run(tasks.wrapper_sees, mode, dispatch)[0]
    wrap, call = _real(rows)  # one bind and one forward call on the real model
    assert (wrap["when"], call["when"]) == ("wrap", "call")
    assert wrap["weight"] == wrap_kind and call["weight"] == call_kind
    assert call["input"] == ("DTensor" if call_kind == "DTensor" else "Tensor")
    local = wrap.get("local_shape", wrap["shape"])
    assert local == (32, 64) and wrap["tp_size"] == 2  # already sharded when bound
    meta = [r for r in rows if r["device"] == "meta"]
    # The verifier runs a dispatching wrapper on its meta copies (validate, then production).
    assert [r["weight"] for r in meta] == (
        ["DTensor", "DTensor", "Parameter", "Parameter"] if dispatch else []
    )


@pytest.mark.parametrize(
    ("mode", "call_kind"), [("production", "Parameter"), ("validate", "Tensor")]
)
def test_what_a_compute_factory_receives(mode: str, call_kind: str) -> None:
    out = get_world(2).run(tasks.factory_sees, mode)[0]
    assert out["before_apply"] == 0  # plan() never calls it
    factory, call = out["seen"]
    assert factory == {
        "when": "factory",
        "weight": "Parameter",
        "shape": (4, 64, 64),  # all 4 experts, whole
        "device": "cpu",
        "ep_mesh": (1, 2),
    }
    assert call["when"] == "call" and call["weight"] == call_kind
    assert call["shape"] == (2, 64, 64)  # this rank's 2 experts
    assert out["loss_diff"] < 1e-5
