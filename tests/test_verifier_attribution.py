"""A meta run that fails in the model's own code, outside every probe, names where it failed.

``verify()`` runs copies of the model; a failure no probe of hp's can attribute is still
named by the module whose code raised it (its path in the user's model, the same in the
copy) and the line, with a fix. The real case: GPT-BigCode with its attention kept whole
under sequence parallel, whose model-level code reshapes ``ln_f``'s sequence-sharded output
to the full sequence.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hp_core import plan, verify
from hp_core.testing.families import build_family
from hp_core.verifier.attribution import failure_site
from hp_core.verifier.errors import UnverifiableError
from hp_core.verifier.runner import _unattributed
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)
from tests.test_error_style import style_problems

pytestmark = pytest.mark.usefixtures("builtin_only")


class _Inner(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(3, -1)  # 2 x 4 elements do not make rows of 3


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Identity(), _Inner())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class _FailsItself(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(3, -1)


def _raised(call) -> BaseException:
    with pytest.raises(RuntimeError) as info:
        call()
    return info.value


def test_the_innermost_module_is_named_by_its_path_from_the_root():
    error = _raised(lambda: _Outer()(torch.ones(2, 4)))
    name, where = failure_site(error)
    assert name == "block.1"
    assert where.startswith("_Inner.forward, test_verifier_attribution.py line ")


def test_a_root_that_fails_in_its_own_code_has_an_empty_name():
    name, where = failure_site(_raised(lambda: _FailsItself()(torch.ones(2, 4))))
    assert name == "" and where.startswith("_FailsItself.forward, ")
    message = _unattributed(_FailsItself(), RuntimeError("boom"))
    assert "failed, outside what hp can attribute: RuntimeError: boom. Fix: " in message


def test_an_error_raised_outside_any_module_has_no_site():
    assert failure_site(_raised(lambda: torch.ones(2, 4).view(3, -1))) is None
    message = _unattributed(_FailsItself(), RuntimeError("boom"))  # no traceback at all
    assert message.startswith("verify(): running _FailsItself on meta tensors failed, outside")


def test_verify_names_the_module_whose_code_failed_on_meta():
    model = build_family("gpt_bigcode", device="meta")
    whole = {"tp": "replicate"}
    overrides = [
        {"match": "transformer.wpe", "is_boundary": False, "params": {"weight": whole}},
        *(
            {
                "match": f"transformer.h.{i}.attn",
                "params": {
                    f"{p}.{w}": whole for p in ("c_attn", "c_proj") for w in ("weight", "bias")
                },
                "out_src": {"attn_output": whole},
            }
            for i in range(2)
        ),
    ]
    # Sequence parallel on, and the final norm made to hand its output over sequence-sharded
    # (the planner would gather it: GPTBigCodeModel views it to the whole-sequence shape).
    sharded = {"tp": "shard(1)"}
    keep_sharded = [
        {"match": "transformer.ln_f", "out_dst": {"output": sharded}},
        {"match": "lm_head", "in_src": {"input": sharded}},
    ]
    planned = plan(model, "tp=2", overrides=[*overrides, *keep_sharded])
    with pytest.raises(UnverifiableError) as info:
        verify(model, planned, "tp=2")
    message = str(info.value)
    assert message.startswith(
        "verify(): running GPTBigCodeForCausalLM on meta tensors failed in 'transformer' "
        "(GPTBigCodeModel.forward, modeling_gpt_bigcode.py line "
    ), message
    assert "RuntimeError: shape '[2, 16, 64]' is invalid" in message
    assert not style_problems(message, "transformer"), style_problems(message, "transformer")
    # Without sequence parallel the same fix verifies: the message's advice holds.
    verify(model, plan(model, "tp=2", overrides=overrides, sequence_parallel=False), "tp=2")
