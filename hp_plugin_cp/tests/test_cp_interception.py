"""The ``*_hf`` wrappers' interception is local to the call: restored on exit, per thread."""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch
import torch.nn.functional as F
from hp_plugin_cp.wrappers import _FunctionShim, _SDPAIntercept


def _modes() -> int:
    return torch._C._len_torch_function_stack()


def test_sdpa_intercept_routes_only_sdpa_and_pops_on_error():
    seen = []
    q = torch.randn(1, 2, 4, 8)
    before = _modes()
    with (
        pytest.raises(RuntimeError, match="boom"),
        _SDPAIntercept(lambda *a, **k: seen.append(k) or q),
    ):
        assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))  # other ops run normally
        assert F.scaled_dot_product_attention(q, q, q, is_causal=True) is q
        raise RuntimeError("boom")
    assert seen == [{"is_causal": True}]
    assert _modes() == before
    F.scaled_dot_product_attention(q, q, q)  # no longer intercepted
    assert len(seen) == 1


@pytest.fixture
def fake_module(monkeypatch):
    mod = types.ModuleType("hp_cp_fake_kernels")
    mod.attend = lambda x: ("original", x)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def test_shim_is_installed_only_while_open_and_restored_on_error(fake_module):
    shim = _FunctionShim(fake_module.__name__, "attend")
    original = fake_module.attend
    with pytest.raises(ValueError), shim.intercept(lambda x: ("mine", x)):
        assert fake_module.attend(1) == ("mine", 1)
        with shim.intercept(lambda x: ("inner", x)):  # nested: innermost wins
            assert fake_module.attend(2) == ("inner", 2)
        assert fake_module.attend(3) == ("mine", 3)
        raise ValueError
    assert fake_module.attend is original


def test_shim_leaves_other_threads_alone(fake_module):
    shim = _FunctionShim(fake_module.__name__, "attend")
    other: list = []
    with shim.intercept(lambda x: ("mine", x)):
        t = threading.Thread(target=lambda: other.append(fake_module.attend(7)))
        t.start()
        t.join()
        assert fake_module.attend(7) == ("mine", 7)
    assert other == [("original", 7)]


def test_shim_does_not_undo_a_later_replacement(fake_module):
    shim = _FunctionShim(fake_module.__name__, "attend")
    later = lambda x: ("later", x)  # noqa: E731
    with shim.intercept(lambda x: ("mine", x)):
        fake_module.attend = later
    assert fake_module.attend is later
