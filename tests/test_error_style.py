"""One error style across hp_core and the plugins (issue 12, item 8).

Every error hp raises for user input has the same shape: its first line names the culprit
(a module FQN, a YAML path, a plugin or distribution, an argument), then comes the rule,
then ``Fix: ...``. This file triggers a representative set of errors, from several layers
of the core and from each bundled plugin, and checks each message with one function,
:func:`style_problems`; two negative controls show that the function catches a message
without a fix and one whose first line does not name the culprit.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

import pytest
import torch
from hp_plugin_cp.collectives import all_gather_kv
from torch import nn

import hp_plugin_cp
import hp_plugin_moe
from hp_core import HpError, plan
from hp_core.context import ParallelContext
from hp_core.injection import InjectionDefinitionError, local_compute
from hp_core.planner.lints import TemplateBuildError
from hp_core.planner.templates import BoundaryTemplate
from hp_core.plans import DuplicateOverrideError, PlanYAMLError, load_overrides, load_plan
from hp_core.plugins import (
    InvalidRegistrationError,
    plugin_report,
    register_compute_factory,
    register_template,
)
from hp_core.spec import ModuleShardingSpec, PlacementSyntaxError, UnknownFieldError
from hp_core.spec.placements import parse_placement
from hp_plugin_cp import CPBatchError, CPConfigError, CPLayout, shard_batch_for_cp
from hp_plugin_moe import MoEConfigError, MoEInterfaceError
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)
from tests._toy_models import head_attention_lm

_FIX = re.compile(r"(^|[\s.;])Fix: \S")


def style_problems(message: str, culprit: str) -> list[str]:
    """What keeps ``message`` from hp's error shape (empty when it has it).

    The shape: the first line names ``culprit`` before anything else is said about it;
    the rule follows; then ``Fix:`` and what to do (never the first thing the message says).
    """
    problems = []
    first = message.partition("\n")[0]
    if culprit not in first:
        problems.append(f"the first line does not name the culprit {culprit!r}: {first!r}")
    fix = _FIX.search(message)
    if fix is None:
        problems.append("no 'Fix: ...' part")
    else:
        before = message[: fix.start()].strip()
        if len(before) <= len(culprit) + 1:
            problems.append("nothing between the culprit and 'Fix:' says what is wrong")
    if not first.strip() or first.startswith("Fix:"):
        problems.append("the message does not start with the culprit")
    return problems


# ------------------------------------------------------------- negative controls


def test_a_message_without_a_fix_is_caught():
    message = "model.layers.0.mlp: 4 experts cannot be split over ep=3 ranks."
    assert style_problems(message, "model.layers.0.mlp") == ["no 'Fix: ...' part"]
    # "fix" as a word, or "Fix:" with nothing after it, is not a fix either
    assert style_problems(message + " Fix the mesh.", "model.layers.0.mlp")
    assert style_problems(message + "\nFix:", "model.layers.0.mlp")


def test_a_message_whose_first_line_lacks_the_culprit_is_caught():
    message = "experts cannot be split over ep=3 ranks.\nmodel.layers.0.mlp\nFix: plan with ep=2."
    (problem,) = style_problems(message, "model.layers.0.mlp")
    assert problem.startswith("the first line does not name the culprit")
    assert style_problems("m: Fix: x", "m") == [
        "nothing between the culprit and 'Fix:' says what is wrong"
    ]


# -------------------------------------------------------------------- the core


def _raises(call: Callable[[], object], cls: type[BaseException]) -> str:
    with pytest.raises(cls) as e:
        call()
    assert isinstance(e.value, HpError), type(e.value)
    return str(e.value)


def _takes_kwargs(module, ctx, **config):
    return None


def _template_bug(ctx: object) -> object:
    raise RuntimeError("template bug")


def _failing_template() -> object:
    register_template(
        BoundaryTemplate("user.bad_norm", "norm", _template_bug, architectures=("ToyCausalLM",))
    )
    return plan(head_attention_lm(), "tp=2")


def _good_factory(module, ctx):
    return None


_DUPLICATES = [
    {"match": "lm_head", "out_dst": {"tp": "replicate"}},
    {"match": "lm_head", "out_names": ["logits"]},
]

CORE = [
    pytest.param(
        lambda: parse_placement("shard(\u0661)", path="overrides[0].params.w.tp"),
        PlacementSyntaxError,
        "overrides[0].params.w.tp",
        id="spec-dsl",
    ),
    pytest.param(
        lambda: ModuleShardingSpec(in_scr={"x": {"tp": "replicate"}}),
        UnknownFieldError,
        "ModuleShardingSpec(in_scr=...)",
        id="spec-keyword",
    ),
    pytest.param(
        lambda: load_plan("version: 1\nmodules: [\n"), PlanYAMLError, "<string>:", id="plan-yaml"
    ),
    pytest.param(
        lambda: load_overrides(_DUPLICATES),
        DuplicateOverrideError,
        "overrides[0] and overrides[1]",
        id="overrides",
    ),
    pytest.param(
        _failing_template,
        TemplateBuildError,
        "model.layers.0.input_layernorm: boundary template 'user.bad_norm'",
        id="planner",
    ),
    pytest.param(
        lambda: register_compute_factory("bad name", local_compute(_good_factory)),
        InvalidRegistrationError,
        "invalid compute factory name 'bad name'",
        id="plugin-registration",
    ),
    pytest.param(
        lambda: local_compute(_takes_kwargs),
        InjectionDefinitionError,
        "@local_compute tests.test_error_style._takes_kwargs: '**config'",
        id="injection-decoration",
    ),
]


@pytest.mark.usefixtures("builtin_only")
@pytest.mark.parametrize(("call", "cls", "culprit"), CORE)
def test_core_errors_have_the_shape(call, cls, culprit):
    message = _raises(call, cls)
    assert style_problems(message, culprit) == [], message


_OLD_API = """
from hp_core import Role, RoleRule

@hookimpl
def hp_register_templates(register):
    register(RoleRule("vone.rule", r"(^|\\.)wqkv\\.weight$", Role.FUSED_QKV, ("XForCausalLM",)))
"""


@pytest.mark.usefixtures("plugin_env")
def test_plugin_loading_refusal_has_the_shape(fakes):
    module = fakes.plugin("vone", _OLD_API, dist="fake-vone", version="1.4")
    path = fakes.root / f"{module}.py"
    path.write_text(path.read_text().replace("HP_PLUGIN_API = 2\n", "HP_PLUGIN_API = 1\n"))
    (row,) = [r for r in plugin_report() if r.name == "vone"]
    assert row.status == "failed"
    assert style_problems(row.error, "plugin 'vone' (fake-vone 1.4)") == [], row.error


# ----------------------------------------------------------------- hp-plugin-cp


class _CPRank:
    """The part of a cp DeviceMesh that shard_batch_for_cp and the wrappers read."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.n = rank, size

    def size(self) -> int:
        return self.n

    def get_local_rank(self) -> int:
        return self.rank

    def get_group(self) -> None:
        return None


def _flex_hf_without_transformers(monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.setitem(sys.modules, "transformers.integrations.flex_attention", None)
    ctx = ParallelContext(("cp",), (2,), cp_mesh=_CPRank(0, 2))
    return hp_plugin_cp.flex_hf(target_module=nn.Linear(2, 2), ctx=ctx)


CP = [
    pytest.param(
        lambda mp: shard_batch_for_cp([torch.zeros(2, 8)], _CPRank(0, 2)),
        CPBatchError,
        "shard_batch_for_cp: batch is a list",
        id="batch-not-a-mapping",
    ),
    pytest.param(
        lambda mp: shard_batch_for_cp({"input_ids": torch.zeros(2, 7)}, _CPRank(0, 2)),
        CPBatchError,
        "sequence (batch['input_ids'] dim 1): length 7",
        id="indivisible-sequence",
    ),
    pytest.param(
        lambda mp: shard_batch_for_cp(
            {"input_ids": torch.zeros(2, 8), "labels": torch.zeros(2, 6)}, _CPRank(0, 2)
        ),
        CPBatchError,
        "shard_batch_for_cp: batch['labels']",
        id="input-shape",
    ),
    pytest.param(lambda mp: CPLayout(2, 2, 8), CPBatchError, "CPLayout: cp_rank 2", id="layout"),
    pytest.param(
        lambda mp: all_gather_kv(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 3, 8), group=None),
        CPBatchError,
        "all_gather_kv: key (1, 2, 4, 8) and value (1, 2, 3, 8)",
        id="packed-kv",
    ),
    pytest.param(
        lambda mp: hp_plugin_cp.enable_cp_loss(nn.Linear(2, 2), _CPRank(0, 2)),
        CPBatchError,
        "enable_cp_loss: Linear",
        id="loss",
    ),
    pytest.param(
        _flex_hf_without_transformers, CPConfigError, "flex_hf on Linear", id="flex-hf-import"
    ),
]


@pytest.mark.parametrize(("call", "cls", "culprit"), CP)
def test_cp_errors_have_the_shape(call, cls, culprit, monkeypatch):
    message = _raises(lambda: call(monkeypatch), cls)
    assert style_problems(message, culprit) == [], message


# ---------------------------------------------------------------- hp-plugin-moe


class _NoRouter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4)])

    def forward(self, hidden_states):
        return hidden_states


class _Block(nn.Module):
    """A Mixtral-shaped block: a linear gate and per-expert SwiGLU experts."""

    top_k = 2

    def __init__(self, forward_extra: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList(
            nn.ModuleDict(
                {
                    "gate_proj": nn.Linear(8, 16, bias=False),
                    "up_proj": nn.Linear(8, 16, bias=False),
                    "down_proj": nn.Linear(16, 8, bias=False),
                }
            )
            for _ in range(4)
        )

    def forward(self, hidden_states):
        return hidden_states


class _NeedsMask(_Block):
    def forward(self, hidden_states, padding_mask):
        return hidden_states


_CTX = {"ctx": ParallelContext((), ())}

MOE = [
    pytest.param(
        lambda: hp_plugin_moe.mixtral(module=_Block(), capacity_factor=0, **_CTX),
        MoEConfigError,
        "mixtral: capacity_factor is 0",
        id="capacity",
    ),
    pytest.param(
        lambda: hp_plugin_moe.mixtral(module=_Block(), router=3, **_CTX),
        MoEConfigError,
        "mixtral: router is 3",
        id="router-name",
    ),
    pytest.param(
        lambda: hp_plugin_moe.mixtral(module=None, **_CTX),
        MoEConfigError,
        "mixtral: module is None",
        id="no-module",
    ),
    pytest.param(
        lambda: hp_plugin_moe.mixtral(module=_NoRouter(), **_CTX),
        MoEInterfaceError,
        "mixtral cannot drive _NoRouter",
        id="no-router",
    ),
    pytest.param(
        lambda: hp_plugin_moe.mixtral(module=_NeedsMask(), **_CTX),
        MoEInterfaceError,
        "_NeedsMask.forward takes required input(s) ['padding_mask']",
        id="forward-inputs",
    ),
]


@pytest.mark.usefixtures("builtin_only")
@pytest.mark.parametrize(("call", "cls", "culprit"), MOE)
def test_moe_errors_have_the_shape(call, cls, culprit):
    message = _raises(call, cls)
    assert style_problems(message, culprit) == [], message
