"""The comparison helpers every equivalence test relies on must be able to fail."""

from __future__ import annotations

import math

import pytest
import torch

from hp_core.testing.compare import (
    allclose_excess,
    assert_weights_changed,
    grads_excess,
    max_abs_diff,
    nan_safe_max,
    run_excess,
    snapshot_params,
    unmoved_params,
    weights_changed,
)


def test_allclose_excess_agrees_with_torch_allclose():
    b = torch.tensor([1.0, -200.0, 0.0])
    for a in (b + 1e-6, b + torch.tensor([0.0, 3e-3, 0.0]), b + 1e-4):
        assert (allclose_excess(a, b) <= 1e-5) == torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert allclose_excess(torch.tensor([]), torch.tensor([])) == 0.0


def test_run_excess_reports_each_quantity_and_refuses_different_gradients():
    ref = (torch.tensor(1.0), torch.zeros(2), {"w": torch.ones(3)})
    got = (torch.tensor(1.5), torch.zeros(2), {"w": torch.ones(3) * 2})
    r = run_excess(got, ref)
    assert (
        r["loss"] == pytest.approx(0.5 - 1e-5)
        and r["logits"] == 0.0
        and r["grad"] == pytest.approx(1 - 1e-5)
    )
    with pytest.raises(AssertionError, match=r"gradient sets differ: \['v', 'w'\]"):
        run_excess(got, (ref[0], ref[1], {"v": torch.ones(3)}))


@pytest.mark.parametrize(
    "a,b",
    [
        (torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])),
        (torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("nan")])),
        (torch.tensor([float("nan")] * 2), torch.tensor([float("nan")] * 2)),
        (torch.tensor([1.0, float("inf")]), torch.tensor([1.0, float("inf")])),
        (torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("-inf")])),
        (torch.ones(2, 3), torch.ones(3)),  # would broadcast
        (torch.ones(1), torch.ones(())),  # would broadcast
        (torch.ones(4), torch.ones(2, 2)),  # same numel
        (torch.zeros(0, 3), torch.zeros(0)),  # empty, but not the same shape
    ],
    ids=[
        "nan-a",
        "nan-b",
        "nan-both",
        "inf-both",
        "-inf-b",
        "broadcast",
        "0d-vs-1d",
        "reshape",
        "empty",
    ],
)
def test_allclose_excess_is_inf_for_non_finite_values_and_shape_mismatches(a, b):
    assert allclose_excess(a, b) == math.inf
    assert allclose_excess(b, a) == math.inf
    assert max_abs_diff({"w": a}, {"w": b}) == {"w": math.inf}


def test_allclose_excess_keeps_exact_values_for_finite_tensors_and_integers():
    assert allclose_excess(torch.tensor(2.0), torch.tensor(1.0), rtol=0.0) == 1.0
    assert allclose_excess(torch.tensor([3, 4]), torch.tensor([3, 5]), rtol=0.0) == 1.0
    assert max_abs_diff({"w": torch.ones(2), "v": torch.ones(1)}, {"w": torch.zeros(2)}) == {
        "v": math.inf,
        "w": 1.0,
    }


def test_run_excess_folds_nan_and_inf_to_inf():
    ref = (torch.tensor(1.0), torch.zeros(2), {"w": torch.ones(3), "v": torch.ones(2)})
    nan_grad = {"w": torch.tensor([1.0, float("nan"), 1.0]), "v": torch.ones(2)}
    r = run_excess((ref[0], ref[1], nan_grad), ref)
    assert r["loss"] <= 0.0 and r["logits"] == 0.0 and r["grad"] == math.inf  # max(0.0, nan) is 0.0
    everything_nan = (
        torch.tensor(float("nan")),
        torch.full((2,), float("nan")),
        {k: torch.full_like(v, float("nan")) for k, v in ref[2].items()},
    )
    assert run_excess(everything_nan, ref) == {
        "loss": math.inf,
        "logits": math.inf,
        "grad": math.inf,
    }
    assert run_excess(ref, everything_nan)["grad"] == math.inf
    assert run_excess((ref[0], torch.zeros(1, 2), ref[2]), ref)["logits"] == math.inf


def test_nan_safe_max():
    assert nan_safe_max([]) == 0.0 and nan_safe_max([], default=-1.0) == -1.0
    assert nan_safe_max([0.5, 2.0, 1.0]) == 2.0
    assert nan_safe_max([0.0, float("nan")]) == math.inf == nan_safe_max([float("nan"), 0.0])
    assert nan_safe_max([1.0, float("-inf")]) == math.inf


def test_weights_changed_compares_local_snapshots():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1, bias=False))
    model(torch.ones(1, 3)).sum().backward()
    model[0].bias.grad = None
    before = snapshot_params(model, only_with_grad=True)
    assert set(before) == {"0.weight", "1.weight"}
    assert all(
        before[n].data_ptr() != p.data_ptr() for n, p in model.named_parameters() if n in before
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    opt.step()
    assert weights_changed(before, model) == {"0.weight": 0.0, "1.weight": 0.0}
    with pytest.raises(
        AssertionError,
        match=r"2 of 2 parameter\(s\) did not change by more than 0 .*\['0.weight', '1.weight'\]",
    ):
        assert_weights_changed(before, model)
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    changes = assert_weights_changed(before, model)
    assert all(0.0 < d < 2e-3 for d in changes.values())
    with pytest.raises(AssertionError, match=r"did not change by more than 0.01"):
        assert_weights_changed(before, model, min_change=1e-2)
    assert unmoved_params(before, model) == []
    assert unmoved_params(before, model, min_change=1e-2) == ["0.weight", "1.weight"]
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    # a weight that became NaN did not "move": inf (never NaN, never a pass)
    assert weights_changed(before, model)["1.weight"] == math.inf
    assert unmoved_params(before, model) == ["1.weight"]
    with pytest.raises(AssertionError, match=r"1 of 2 parameter\(s\) .*\['1.weight'\]"):
        assert_weights_changed(before, model)
    with torch.no_grad():
        model[1].weight[0, 0] = float("inf")
    assert unmoved_params(before, model) == ["1.weight"]
    with pytest.raises(AssertionError, match=r"\['1.weight'\]"):
        assert_weights_changed(before, model)
    # a NaN in the snapshot: inf, not NaN (a NaN change would compare false both ways)
    with torch.no_grad():
        model[1].weight[0, 0] = 0.5
    nan_before = {**before, "1.weight": torch.full_like(before["1.weight"], float("nan"))}
    assert weights_changed(nan_before, model)["1.weight"] == math.inf
    assert unmoved_params(nan_before, model) == ["1.weight"]
    with pytest.raises(AssertionError, match=r"\['1.weight'\]"):
        assert_weights_changed(nan_before, model)
    with pytest.raises(KeyError, match="gone since the snapshot"):
        weights_changed({**before, "2.weight": torch.ones(1)}, model)
    with pytest.raises(KeyError, match="gone since the snapshot"):
        unmoved_params({**before, "2.weight": torch.ones(1)}, model)


def test_grads_excess_is_nan_safe_and_refuses_different_gradient_sets():
    ref = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}
    assert grads_excess(ref, ref, rtol=1e-5) <= 0.0
    assert grads_excess({}, {}, rtol=1e-5) == 0.0
    off = {**ref, "b": torch.tensor([3.5])}
    assert grads_excess(off, ref, rtol=0.0) == pytest.approx(0.5)
    assert grads_excess(off, ref, rtol=1e-5) == max(
        allclose_excess(off[n], ref[n], rtol=1e-5) for n in ref
    )
    for bad in (float("nan"), float("inf")):
        assert grads_excess({**ref, "a": torch.tensor([1.0, bad])}, ref, rtol=1e-5) == math.inf
        assert grads_excess(ref, {**ref, "a": torch.tensor([1.0, bad])}, rtol=1e-5) == math.inf
    assert grads_excess({"a": ref["a"]}, ref, rtol=1e-5) == math.inf  # a gradient missing
    assert grads_excess({**ref, "c": torch.zeros(1)}, ref, rtol=1e-5) == math.inf  # one extra
    assert grads_excess({**ref, "a": torch.zeros(3)}, ref, rtol=1e-5) == math.inf  # a shape
