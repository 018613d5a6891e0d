"""Production's lowered collectives give exactly what DTensor's redistribute gives, both ways."""

from __future__ import annotations

import pytest

from hp_core.testing import get_world
from tests import dist_tasks_layouts as tasks

pytestmark = pytest.mark.distributed

CASES = [
    # mesh names, src, dst, grad-partial axes, expect lowered
    (("dp", "tp"), {"tp": "s1"}, {"tp": "r"}, ("tp",), True),
    (("dp", "tp"), {"tp": "s1"}, {"tp": "r"}, (), True),
    (("dp", "tp"), {"tp": "r"}, {"tp": "s1"}, (), True),
    (("dp", "tp"), {"tp": "p"}, {"tp": "r"}, (), True),
    (("dp", "tp"), {"tp": "p"}, {"tp": "s1"}, (), True),
    (("dp", "tp"), {"tp": "r"}, {"tp": "r"}, ("tp",), True),
    (("dp", "tp"), {"tp": "s0"}, {"tp": "s1"}, (), False),  # all-to-all: DTensor fallback
    (("cp", "tp"), {"cp": "s1", "tp": "s1"}, {"cp": "s1", "tp": "r"}, ("tp",), True),  # tp inner
    (("tp", "cp"), {"tp": "s1", "cp": "s1"}, {"tp": "r", "cp": "s1"}, ("tp",), False),  # tp outer
    (("cp", "tp"), {"cp": "s1", "tp": "s1"}, {"cp": "r", "tp": "r"}, (), False),  # two axes
]


@pytest.mark.parametrize("names,src,dst,grad_partial,lowered", CASES)
def test_lowered_transition_matches_dtensor(names, src, dst, grad_partial, lowered):
    for r in get_world(4).run(tasks.compare_transition, names, src, dst, grad_partial):
        assert r["lowered"] is lowered and not r["identity"]
        assert r["fwd"] < 1e-6 and r["bwd"] < 1e-6, r
        assert r["non_tensor_passes"]
