"""Planning stays linear in the depth of the model (issue 14, item 11).

A meta-device llama of 128 and of 512 layers is planned and explained in the same run;
four times the layers must cost less than six times the time (linear is 4, quadratic 16).
CPU time of this process is measured (the best of two), so other work on the machine does
not count.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import pytest

from hp_core import plan
from hp_core.testing.families import build_family
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("builtin_only")

SHALLOW, DEEP = 128, 512
#: Linear is 4; quadratic would be 16. Six leaves room for timing noise, not for n log n
#: with a large constant, nor for anything quadratic.
MAX_RATIO = 6.0


def _best_cpu_seconds(work: Callable[[], object]) -> tuple[float, object]:
    """The best of two CPU timings of ``work()`` in this process, and what it returned."""
    best = float("inf")
    for _ in range(2):
        gc.collect()
        start = time.process_time()
        result = work()
        best = min(best, time.process_time() - start)
    return best, result


def _plan_seconds(layers: int) -> float:
    """The CPU time of ``plan(...)`` and its ``explain()`` for a meta llama of ``layers``."""
    model = build_family("llama", device="meta", num_hidden_layers=layers)

    def work() -> tuple[Any, str]:
        planned = plan(model, "tp=2")
        return planned, planned.explain()

    seconds, (planned, text) = _best_cpu_seconds(work)
    # Every layer planned: the layer, its attention, MLP and two norms; plus the embedding,
    # the final norm and the head.
    assert len(planned.modules) == 5 * layers + 3
    assert f"model.layers.{layers - 1}.mlp\n" in text
    return seconds


def test_planning_a_deep_model_is_linear_in_its_layers():
    shallow, deep = _plan_seconds(SHALLOW), _plan_seconds(DEEP)
    ratio = deep / shallow
    assert ratio < MAX_RATIO, (
        f"planning {DEEP} layers took {deep:.2f}s, {ratio:.1f}x the {shallow:.2f}s of {SHALLOW} "
        f"layers ({DEEP // SHALLOW}x the layers): not linear"
    )


def test_the_timing_tells_quadratic_work_from_linear():
    """Negative control: the same measurement on work quadratic in the count exceeds the bound."""

    def pairs(n: int) -> Callable[[], object]:
        return lambda: sum(1 for i in range(n) for j in range(n) if i < j)

    ratio = _best_cpu_seconds(pairs(DEEP))[0] / _best_cpu_seconds(pairs(SHALLOW))[0]
    assert ratio > MAX_RATIO, ratio
