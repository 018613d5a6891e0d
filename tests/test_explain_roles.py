"""``hp_core.explain_roles`` and ``hp plan --explain-roles``: why each parameter has its role.

Every row names the rule that decided the role and the plugin that provided it; the
placements are the plan's own (checked against ``hp_core.plan`` for every family of the
matrix); unclaimed parameters and fused projections have their own sections, and a
refused plan is reported with its fix instead of stopping the report.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hp_core import (
    HpError,
    ModuleRule,
    RoleReport,
    ShardingPlan,
    cli,
    explain_roles,
    plan,
    register_template,
    role_report,
)
from hp_core.cli.model_args import load_model
from hp_core.planner.plan import plan as raw_plan
from hp_core.planner.templates.roles import DEFAULT_ROLE_RULES, Role
from hp_core.plugins import TEMPLATE_REGISTRY, reset_plugins, unregister
from hp_core.plugins._config import ENV_DISABLE_AUTOLOAD, ENV_PLUGINS, ENV_STRICT
from hp_core.spec.placements import parse_placement
from hp_core.testing.external_models import NanoGPT, TitanTransformer
from hp_core.testing.families import build_family
from hp_core.testing.family_matrix import FAMILY_NAMES
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)
from tests._toy_models import OneHeadNanoGPT

CORE_RULES = {r.name for r in DEFAULT_ROLE_RULES}
#: The keep-whole override the one-head nanoGPT's refusal proposes, for every layer.
NANO_KEEP_WHOLE = [
    {
        "match": "transformer.h.*.attn",
        "params": {
            p: {"tp": "replicate"}
            for p in ("c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias")
        },
        "out_src": {"output": {"tp": "replicate"}},
    }
]


@pytest.fixture
def with_plugins(monkeypatch):
    """Every installed plugin loaded (the phi3 plugin among them)."""
    for var in (ENV_PLUGINS, ENV_STRICT, ENV_DISABLE_AUTOLOAD):
        monkeypatch.delenv(var, raising=False)
    reset_plugins()
    if "phi3.fused_qkv" not in TEMPLATE_REGISTRY:
        pytest.fail("hp-plugin-phi3 is not installed in this environment")
    yield
    reset_plugins()


def _meta(cls: type[nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return cls()


def placement_mismatches(report: RoleReport, planned) -> list[str]:
    """Every parameter whose report placements differ from the plan's declared layout
    (an undeclared parameter is replicated on every axis)."""
    expected: dict[str, dict] = {}
    for fqn, spec in planned.modules.items():
        for rel, named in (spec.params or {}).items():
            for src in spec._ep_stack.get(rel) or [rel]:
                expected[f"{fqn}.{src}" if fqn else src] = named  # inner boundaries come later
    bad = []
    for row in report.rows:
        got = {a: parse_placement(t) for a, t in (row.placements or {}).items()}
        want = expected.get(row.fqn, {})
        full = {a: want.get(a, parse_placement("replicate")) for a in planned.mesh_axis_names}
        if got != full:
            bad.append(f"{row.fqn}: report {got} != plan {full}")
    return bad


@pytest.mark.usefixtures("builtin_only")
def test_llama_every_parameter_once_with_core_rules():
    model = build_family("llama", device="meta")
    report = explain_roles(model, "tp=2")
    names = [n for n, _ in model.named_parameters()]
    assert [r.fqn for r in report.rows] == names
    assert {r.provider for r in report.rows} == {"core"}
    for row in report.rows:
        assert row.via == "name_hint", row
        assert row.rule.removeprefix("name hint ") in CORE_RULES, row
    assert report.row("model.layers.0.self_attn.q_proj.weight").rule == "name hint role.colwise"
    o_proj = report.row("model.layers.0.self_attn.o_proj.weight")
    assert o_proj.placements == {"tp": "shard(1)"}
    assert (o_proj.boundary, o_proj.template) == (
        "attention model.layers.0.self_attn",
        "boundary.attention",
    )
    assert report.unclaimed == [] and report.refusal is None
    assert placement_mismatches(report, plan(model, "tp=2")) == []
    text = report.text()
    assert all(text.count(f"\n{n} ") == 1 for n in names)
    assert "unclaimed (no rule or structure decided the role; replicated): none" in text


def test_phi3_rules_come_from_its_plugin(with_plugins):
    report = explain_roles(build_family("phi3", device="meta"), "tp=2")
    qkv = report.row("model.layers.0.self_attn.qkv_proj.weight")
    assert (qkv.rule, qkv.via, qkv.role) == ("phi3.fused_qkv", "role_rule", Role.FUSED_QKV)
    assert qkv.provider == "phi3 (hp-plugin-phi3)"
    down = report.row("model.layers.1.mlp.down_proj.weight")
    assert (down.rule, down.provider) == ("phi3.down_proj", "phi3 (hp-plugin-phi3)")
    # The norms are still the core's: the plugin names only its projections.
    assert report.row("model.norm.weight").provider == "core"


@pytest.mark.usefixtures("builtin_only")
def test_phi3_without_its_plugin_the_core_decides():
    report = explain_roles(build_family("phi3", device="meta"), "tp=2")
    qkv = report.row("model.layers.0.self_attn.qkv_proj.weight")
    assert (qkv.rule, qkv.provider) == ("name hint role.fused_qkv", "core")
    assert {r.provider for r in report.rows} == {"core"}


@pytest.mark.usefixtures("builtin_only")
def test_structure_decides_what_names_leave_open():
    report = explain_roles(_meta(TitanTransformer), "tp=2")
    wq = report.row("layers.0.attention.wq.weight")
    assert (wq.rule, wq.via, wq.provider, wq.role) == (
        "structure (trace)",
        "structure",
        "core",
        Role.COLWISE,
    )
    assert report.row("tok_embeddings.weight").rule == "structure (trace: token embedding)"
    assert report.row("output.weight").role is Role.LM_HEAD


@pytest.mark.usefixtures("builtin_only")
def test_a_free_parameter_is_unclaimed_not_declared_replicated():
    model = _meta(TitanTransformer)
    with torch.device("meta"):
        model.layers["0"].attention.sink = nn.Parameter(torch.zeros(4))
    report = explain_roles(model, "tp=2")
    sink = report.row("layers.0.attention.sink")
    assert (sink.role, sink.via, sink.placements) == (
        Role.REPLICATED,
        "unclaimed",
        {"tp": "replicate"},
    )
    assert [r.fqn for r in report.unclaimed] == ["layers.0.attention.sink"]
    assert "unclaimed (no rule or structure decided the role; replicated): 1\n" in report.text()
    # Negative control: a parameter the structure keeps whole is declared, not unclaimed.
    gpt2 = explain_roles(build_family("gpt2", device="meta"), "tp=2")
    assert gpt2.unclaimed == []


@pytest.mark.usefixtures("builtin_only")
def test_a_free_parameter_nothing_claims_is_reported_with_the_refusal():
    model = _meta(TitanTransformer)
    with torch.device("meta"):
        model.temperature = nn.Parameter(torch.zeros(1))
    report = explain_roles(model, "tp=2")
    assert report.refusal is not None
    assert report.refusal.startswith("UncoveredParameterError: ")
    assert "temperature" in [r.fqn for r in report.unclaimed]
    assert all(r.placements is None for r in report.rows)  # no plan, no placements
    assert "plan: refused: UncoveredParameterError" in report.text()


@pytest.mark.usefixtures("builtin_only")
def test_gpt2_fused_c_attn_shows_the_proven_layout():
    report = explain_roles(build_family("gpt2", device="meta"), "tp=2")
    fused = {f.fqn: f for f in report.fused}
    assert set(fused) == {
        f"transformer.h.{i}.attn.c_attn.{p}" for i in (0, 1) for p in ("weight", "bias")
    }
    weight = fused["transformer.h.0.attn.c_attn.weight"]
    assert weight.refusal is None
    assert weight.layout == (
        "proven: concatenated along dim 1: [q 64 (4 units), k 64 (4 units), v 64 (4 units)]"
    )
    assert f"  transformer.h.0.attn.c_attn.weight (fused_qkv): {weight.layout}" in report.text()
    # tp=1: nothing is split, so there is no fused section.
    assert explain_roles(build_family("gpt2", device="meta"), "cp=2").fused == []


@pytest.mark.usefixtures("builtin_only")
def test_nanogpt_fused_refusal_with_its_keep_whole_fix_and_the_fix_works():
    """nanoGPT itself plans (its heads are read off its forward); with one-head attention
    nothing says where whole heads are, so its fused q/k/v is refused with the fix."""
    assert explain_roles(_meta(NanoGPT), "tp=2").refusal is None
    report = explain_roles(_meta(OneHeadNanoGPT), "tp=2")
    assert report.refusal is not None and report.refusal.startswith("FusedProjectionError: ")
    [refused] = [f for f in report.fused if f.refusal is not None]
    assert refused.fqn == "transformer.h.0.attn.c_attn.weight"
    assert "cannot read the head count" in refused.refusal
    assert refused.fix is not None and "- match: 'transformer.h.*.attn'" in refused.fix
    assert "c_attn.weight: {tp: replicate}" in refused.fix
    text = report.text()
    assert "    Fix: keep the boundary whole on tp" in text
    assert "plan: refused (FusedProjectionError, shown above)" in text
    # The proposed fix, for every layer, plans; the override is then the deciding rule.
    fixed = explain_roles(_meta(OneHeadNanoGPT), "tp=2", overrides=NANO_KEEP_WHOLE)
    assert fixed.refusal is None, fixed.refusal
    row = fixed.row("transformer.h.1.attn.c_attn.weight")
    assert (row.rule, row.via, row.provider) == (
        "override 'transformer.h.*.attn'",
        "override",
        "user",
    )
    assert row.role_rule == "name hint role.fused_qkv" and row.placements == {"tp": "replicate"}
    assert "override 'transformer.h.*.attn' (role: name hint role.fused_qkv)" in fixed.text()
    assert fixed.row("transformer.h.1.mlp.c_fc.weight").via == "name_hint"  # not overridden
    assert {f.layout for f in fixed.fused} == {"not split on its fused dim (kept whole)"}


class _Recorded:
    """The planner as explain_roles calls it, keeping what it returned or raised: the report
    is checked against that very call. It plans without the checked-fix search that
    hp_core.plan adds to a refusal (a search of many plans and verifies per refused family,
    tested in test_printed_fixes.py): the rows and placements do not depend on it."""

    def __init__(self) -> None:
        self.result: object = None

    def __call__(self, *args, **kwargs):
        try:
            self.result = raw_plan(*args, **kwargs)
        except HpError as e:
            self.result = e
            raise
        return self.result


@pytest.mark.usefixtures("builtin_only")
def test_the_report_matches_the_plan_for_every_family(monkeypatch):
    refused = planned = 0
    for name in FAMILY_NAMES:
        model = build_family(name, device="meta")
        recorded = _Recorded()
        monkeypatch.setattr(role_report, "plan", recorded)
        report = explain_roles(model, "tp=2")
        assert [r.fqn for r in report.rows] == [n for n, _ in model.named_parameters()], name
        expected = recorded.result
        if isinstance(expected, HpError):
            refused += 1
            assert report.refusal == f"{type(expected).__name__}: {expected}", name
            continue
        assert isinstance(expected, ShardingPlan), name
        planned += 1
        assert report.refusal is None, (name, report.refusal)
        assert placement_mismatches(report, expected) == [], name
        fused = {f.fqn for f in report.fused}
        assert fused == {
            r.fqn for r in report.rows if r.role in (Role.FUSED_QKV, Role.FUSED_GATE_UP)
        }
        for row in report.rows:
            assert row.via != "unclaimed" or row.role is Role.REPLICATED, (name, row)
    assert refused and planned > refused  # both branches taken


@pytest.mark.usefixtures("builtin_only")
def test_the_differential_check_catches_a_wrong_placement():
    """Negative control: a plan whose layout differs from the report is caught."""
    model = build_family("llama", device="meta")
    report = explain_roles(model, "tp=2")
    other = plan(model, "tp=2")
    spec = other.modules["model.layers.0.mlp"]
    spec.params["down_proj.weight"] = {"tp": parse_placement("shard(0)")}
    assert placement_mismatches(report, other) == [
        "model.layers.0.mlp.down_proj.weight: report {'tp': Shard(dim=1)} != plan "
        "{'tp': Shard(dim=0)}"
    ]


@pytest.mark.usefixtures("builtin_only")
def test_cli_explain_roles_prints_the_report(capsys):
    code = cli.main(["plan", "--model", "llama", "--mesh", "tp=2", "--explain-roles"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert out == explain_roles(load_model("llama"), "tp=2").text()
    assert out.startswith("roles: mesh tp=2; ")


@pytest.mark.usefixtures("builtin_only")
def test_cli_explain_roles_of_a_refused_model_prints_the_table_then_exits_1(capsys):
    model = "tests._toy_models:OneHeadNanoGPT"
    code = cli.main(["plan", "--model", model, "--mesh", "tp=2", "--explain-roles"])
    out, err = capsys.readouterr()
    assert code == 1
    assert out == explain_roles(_meta(OneHeadNanoGPT), "tp=2").text()
    assert err.startswith("hp plan: error: the planner refuses this model: FusedProjectionError: ")
    assert err.count("\n") == 1


def test_cli_explain_roles_is_not_combined_with_yaml(capsys):
    code = cli.main(["plan", "--model", "llama", "--mesh", "tp=2", "--explain-roles", "--yaml"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert "--explain-roles prints the role report only" in err


def test_bad_arguments_raise_as_plan_does():
    with pytest.raises(HpError, match=r"model must be a torch\.nn\.Module"):
        explain_roles("llama", "tp=2")  # type: ignore[arg-type]


@pytest.mark.usefixtures("builtin_only")
def test_a_user_module_rule_declares_replicated_and_an_exact_override_decides():
    rule = ModuleRule("user.titan.0", r"\.feed_forward$", "keep", ("TitanTransformer",))
    register_template(rule)
    try:
        report = explain_roles(
            _meta(TitanTransformer),
            "tp=2",
            overrides=[
                {
                    "match": "layers.1.attention",
                    "params": {f"w{x}.weight": {"tp": "replicate"} for x in "qkvo"},
                    "out_src": {"output": {"tp": "replicate"}},
                },
                {
                    "match": "layers.0.attention",
                    "when": "cp",
                    "params": {"wq.weight": {"tp": "replicate"}},
                },
            ],
        )
    finally:
        unregister("template", "user.titan.0")
    w1 = report.row("layers.0.feed_forward.w1.weight")
    assert (w1.role, w1.via, w1.rule, w1.provider) == (
        Role.REPLICATED,
        "module_rule",
        "user.titan.0",
        "user",
    )
    assert w1.placements == {"tp": "replicate"} and report.unclaimed == []  # declared, not free
    wq = report.row("layers.1.attention.wq.weight")
    assert (wq.rule, wq.role_rule, wq.placements) == (
        "override 'layers.1.attention'",
        "structure (trace)",
        {"tp": "replicate"},
    )
    assert report.row("layers.0.attention.wq.weight").via == "structure"  # when: cp is inactive
    with pytest.raises(KeyError):
        report.row("no.such.weight")


@pytest.mark.usefixtures("builtin_only")
def test_cli_explain_roles_with_a_malformed_overrides_file_exits_1(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- match: model.layers.0.mlp\n  params: {down_proj.weight: {tp: sideways}}\n")
    argv = [
        "plan",
        "--model",
        "llama",
        "--mesh",
        "tp=2",
        "--explain-roles",
        "--overrides",
        str(bad),
    ]
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert (code, out) == (1, "")
    assert err.startswith("hp plan: error: OverrideError: ") and "sideways" in err
