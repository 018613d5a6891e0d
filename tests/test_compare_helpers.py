"""The comparison helpers every equivalence test relies on must be able to fail."""

from __future__ import annotations

import pytest
import torch

from hp_core.testing.compare import allclose_excess, run_excess


def test_allclose_excess_agrees_with_torch_allclose():
    b = torch.tensor([1.0, -200.0, 0.0])
    for a in (b + 1e-6, b + torch.tensor([0.0, 3e-3, 0.0]), b + 1e-4):
        assert (allclose_excess(a, b) <= 1e-5) == torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert allclose_excess(torch.tensor([]), torch.tensor([])) == 0.0


def test_run_excess_reports_each_quantity_and_refuses_different_gradients():
    ref = (torch.tensor(1.0), torch.zeros(2), {"w": torch.ones(3)})
    got = (torch.tensor(1.5), torch.zeros(2), {"w": torch.ones(3) * 2})
    r = run_excess(got, ref)
    assert r["loss"] == pytest.approx(0.5 - 1e-5) and r["logits"] == 0.0 and r["grad"] == pytest.approx(1 - 1e-5)
    with pytest.raises(AssertionError, match=r"gradient sets differ: \['v', 'w'\]"):
        run_excess(got, (ref[0], ref[1], {"v": torch.ones(3)}))
