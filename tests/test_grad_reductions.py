"""hp's derived gradient sums under the ways people call backward.

(FSDP2/DDP composition: tests/test_dp_composition.py; accumulation: test_tp_equivalence.py.)
"""

from __future__ import annotations

import pytest

from hp_core.testing import get_world
from tests import dist_tasks_grads as tasks

pytestmark = pytest.mark.distributed


def test_two_backwards_through_one_forward_each_add_only_their_share():
    for r in get_world(2).run(tasks.two_backwards_through_one_forward):
        assert r["excess"] <= 1e-5, r
        # one bucketed sum per backward; with nothing else managing the gradients, it started
        # as soon as the bucket's last gradient arrived, before the end of backward
        assert r["reductions"] == 2 and r["early"] == 2


def test_finalize_after_the_automatic_sum_changes_nothing():
    for r in get_world(2).run(tasks.finalize_is_idempotent):
        assert r["excess"] <= 1e-5 and r["reductions"] == 1


def test_a_learned_activation_parameter_gets_its_whole_gradient():
    for r in get_world(2).run(tasks.learned_activation_matches):
        assert r["excess"] <= 1e-5 and r["beta_grad"] != 0.0, r
