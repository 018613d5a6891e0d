"""Roles from structure: type, shapes and the meta dataflow trace decide what names do not.

Planning only (no process group): each case builds a tiny hand-written model and checks
the roles, blocks and plan the structure gives, the precedence of name rules and module
rules, the fallback when the trace cannot run, and that nothing of the model changes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from transformers.pytorch_utils import Conv1D

from hp_core import HpError, ModuleRule, Role, RoleRule, plan
from hp_core.planner.infer_roles import infer_roles, is_linear_like
from hp_core.planner.lints import PlanningError
from hp_core.planner.structure import UncoveredParameterError, analyse
from hp_core.planner.templates import DEFAULT_ROLE_RULES, TemplateDefinitionError
from hp_core.planner.trace import TraceFailedError, is_norm_module, trace
from hp_core.plugins import register_template, unregister
from hp_core.testing.external_models import build_external

D, F_, V = 32, 64, 96


class Attn(nn.Module):
    def __init__(self, eager: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(D, D) for _ in range(3))
        self.d = nn.Linear(D, D)
        self.eager = eager

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, s, _ = x.shape
        q, k, v = (f(x).view(bs, s, -1, 8).transpose(1, 2) for f in (self.a, self.b, self.c))
        if self.eager:
            y = torch.matmul(torch.matmul(q, k.transpose(-1, -2)).softmax(-1), v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.d(y.transpose(1, 2).reshape(bs, s, -1))


class FusedUp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up2 = nn.Linear(D, 2 * F_, bias=False)
        self.back = nn.Linear(F_, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.up2(x).chunk(2, dim=-1)
        return self.back(F.silu(g) * u)


class ConvMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = Conv1D(F_, D)
        self.outp = Conv1D(D, F_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outp(F.gelu(self.inp(x)))


class Net(nn.Module):
    def __init__(self, mlp: nn.Module | None = None, fail_on_meta: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.where = nn.Embedding(16, D)
        self.n1 = nn.LayerNorm(D)
        self.att = Attn()
        self.n2 = nn.LayerNorm(D)
        self.ff = mlp if mlp is not None else ConvMLP()
        self.to_vocab = nn.Linear(D, V, bias=False)
        self.fail_on_meta = fail_on_meta

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.fail_on_meta and ids.is_meta:
            raise RuntimeError("this forward needs real data")
        x = self.tok(ids) + self.where(torch.arange(ids.shape[1], device=ids.device))
        x = x + self.att(self.n1(x))
        x = x + self.ff(self.n2(x))
        return self.to_vocab(x)


def _roles(model: nn.Module, **kw) -> dict[str, Role]:
    return analyse(model, DEFAULT_ROLE_RULES, **kw).roles


def test_every_role_is_read_from_structure():
    roles = _roles(Net())
    assert roles["tok.weight"] is Role.EMBED
    assert roles["where.weight"] is Role.REPLICATED  # positions: kept whole
    assert roles["n1.weight"] is roles["n2.bias"] is Role.NORM
    assert {roles[f"att.{n}.weight"] for n in "abc"} == {Role.COLWISE}
    assert roles["att.d.weight"] is Role.ROWWISE
    assert roles["ff.inp.weight"] is roles["ff.inp.bias"] is Role.COLWISE  # Conv1D [in, out]
    assert roles["ff.outp.weight"] is Role.ROWWISE
    assert roles["to_vocab.weight"] is Role.LM_HEAD


def test_the_plan_of_a_model_with_no_known_name():
    p = plan(Net(), "tp=2")
    att = {k: v["tp"] for k, v in p["att"].params.items()}
    assert att["a.weight"] == att["a.bias"] == Shard(0) and att["d.weight"] == Shard(1)
    assert p["where"].params["weight"]["tp"] == Replicate() and p["where"].is_boundary
    assert p["tok"].params["weight"]["tp"] == Shard(0)
    assert p.notes == []


def test_eager_attention_is_seen_too():
    model = Net()
    model.att = Attn(eager=True)
    assert _roles(model)["att.a.weight"] is Role.COLWISE


def test_a_fused_gate_up_is_found_by_its_width():
    """No name says so: the up projection twice as wide as its consumer's input is gate/up,
    planned re-arranged so each rank holds its rows of both halves."""
    ff = plan(Net(mlp=FusedUp()), "tp=2")["ff"]
    assert ff.params["up2.weight"]["tp"] == Shard(0) and ff.params["back.weight"]["tp"] == Shard(1)
    layout = ff._fused_layouts["up2.weight"]
    assert (layout["kind"], layout["parts"]) == ("gate_up", [F_, F_])


def test_name_rules_scoped_to_the_architecture_win():
    rule = RoleRule("t.keep_d", r"att\.d\.", Role.REPLICATED, architectures=("Net",))
    roles = analyse(Net(), [rule, *DEFAULT_ROLE_RULES]).roles
    assert roles["att.d.weight"] is Role.REPLICATED
    assert roles["att.a.weight"] is Role.COLWISE


def test_a_module_rule_declares_a_kind():
    register_template(ModuleRule("t.keep_ff", r"^ff$", "keep"))
    register_template(ModuleRule("t.norm_cls", nn.Embedding, "norm", architectures=("Other",)))
    try:
        p = plan(Net(), "tp=2")
        assert {v["tp"] for v in p["ff"].params.values()} == {Replicate()}
        assert p["tok"].params["weight"]["tp"] == Shard(0)  # the scoped rule does not apply
    finally:
        unregister("template", "t.keep_ff")
        unregister("template", "t.norm_cls")


def test_a_module_rule_can_name_a_block_kind():
    rule = ModuleRule("t.mlp", "Attn", "mlp")
    structure = analyse(Net(), DEFAULT_ROLE_RULES, [rule])
    assert {b.fqn: b.kind for b in structure.blocks}["att"] == "mlp"
    lm = ModuleRule("t.head", "to_vocab", "lm_head")
    assert analyse(Net(), DEFAULT_ROLE_RULES, [lm]).roles["to_vocab.weight"] is Role.LM_HEAD


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"match": "x", "kind": "rowwise"}, "kind must be one of"),
        ({"match": "x", "kind": "keep", "architectures": "Llama"}, "architectures must be"),
        ({"match": "(", "kind": "keep"}, "is not a regular expression"),
        ({"match": int, "kind": "keep"}, "must be an nn.Module subclass"),
        ({"match": 3, "kind": "keep"}, "must be a regular expression, a class name"),
    ],
)
def test_a_bad_module_rule_is_refused(kwargs, match):
    with pytest.raises(TemplateDefinitionError, match=match) as e:
        ModuleRule("t.bad", **kwargs)
    assert "Fix:" in str(e.value)


def test_a_forward_that_fails_on_meta_falls_back_and_says_so():
    with pytest.raises(UncoveredParameterError) as e:
        plan(Net(fail_on_meta=True), "tp=2")
    msg = str(e.value)
    assert "att.a.weight" in msg and "could not run" in msg and "this forward needs real" in msg
    roles = _roles(Net(fail_on_meta=True))  # type and shape still decide these
    assert roles["tok.weight"] is Role.EMBED and roles["where.weight"] is Role.REPLICATED
    assert roles["n1.weight"] is Role.NORM and roles["to_vocab.weight"] is Role.LM_HEAD


def test_the_fallback_plans_when_names_cover_the_projections():
    model = Net(fail_on_meta=True)
    rules = [
        RoleRule("t.col", r"att\.[abc]\.|ff\.inp\.", Role.COLWISE),
        RoleRule("t.row", r"att\.d\.|ff\.outp\.", Role.ROWWISE),
        *DEFAULT_ROLE_RULES,
    ]
    for r in rules[:2]:
        register_template(r)
    try:
        p = plan(model, "tp=2")
    finally:
        unregister("template", "t.col")
        unregister("template", "t.row")
    assert any("could not run" in n for n in p.notes)
    assert p["to_vocab"].params["weight"]["tp"] == Shard(0)


def test_a_parameter_nothing_classifies_is_refused():
    model = Net()
    model.temperature = nn.Parameter(torch.ones(3))  # read by no module nothing can classify
    with pytest.raises(UncoveredParameterError, match=r"temperature \(replicated, shape \(3,\)\)"):
        plan(model, "tp=2")


def test_the_trace_changes_nothing_and_runs_on_meta_models():
    model = Net()
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    flows = trace(model)
    assert flows.embeddings == {"tok": True, "where": False}
    after = model.state_dict()
    assert all(
        after[k].data_ptr() == p and torch.equal(after[k], t) for k, (p, t) in before.items()
    )
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks
    with torch.device("meta"):
        meta = Net()
    assert set(trace(meta).projections) == set(flows.projections)
    with pytest.raises(TraceFailedError, match="needs real data"):
        trace(Net(fail_on_meta=True))


def test_type_predicates():
    assert is_linear_like(nn.Linear(2, 2)) and is_linear_like(Conv1D(2, 2))
    assert not is_linear_like(nn.Embedding(2, 2))
    assert is_norm_module(nn.LayerNorm(4)) and is_norm_module(nn.RMSNorm(4))
    assert not is_norm_module(nn.Linear(4, 4)) and not is_norm_module(nn.Module())


def test_undecided_parameters_only_are_inferred():
    inf = infer_roles(Net(), [])
    assert inf.roles == {} and inf.notes == []
    inf = infer_roles(build_external("tiny_gpt"), ["pos.weight"])
    assert inf.roles == {"pos.weight": Role.REPLICATED} and inf.kinds == {"pos": "keep"}


def test_projections_beside_a_layer_code_attention_refuse_context_parallelism():
    with torch.device("meta"):
        model = build_external("flat_gpt")
    p = plan(model, "tp=2")
    assert p["blocks.0.q"].params["weight"]["tp"] == Shard(0)  # one boundary per Linear
    assert p["blocks.0.j"].params["weight"]["tp"] == Shard(1)
    with pytest.raises(PlanningError, match=r"^blocks\.0\.q: this projection feeds") as e:
        plan(model, "tp=2,cp=2")
    assert "Fix:" in str(e.value)
    plan(build_external("tiny_gpt"), "tp=2,cp=2")  # its attention is a module of its own


def test_an_mlp_taking_a_second_activation_is_kept_whole_on_tp():
    """MPT's MLP adds ``residual`` to its row-parallel output itself: a split contract cannot
    declare that (the exit reduction would count it tp times), so the block is kept whole —
    both activations gathered, its own code run once on whole tensors — and a note says why."""
    from hp_core.testing.families import build_family
    from hp_core.testing.printed_fix import printed_fix

    with pytest.raises(HpError) as refused:  # its attention (ALiBi per global head) is refused
        plan(build_family("mpt", seed=0), "tp=2", sequence_parallel=False)
    fix = printed_fix(str(refused.value))  # ... with a fix that keeps it whole as well
    assert fix is not None and fix.overrides[0]["match"] == "transformer.blocks.*.attn"
    overrides = fix.overrides
    p = plan(build_family("mpt", seed=0), "tp=2", sequence_parallel=False, overrides=overrides)
    ffn = p["transformer.blocks.0.ffn"]
    assert set(ffn.in_dst) == {"hidden_states", "residual"}
    assert all(str(n["tp"]) == "R" for n in ffn.in_dst.values())
    assert ffn.region_dispatch is False
    assert {str(n["tp"]) for n in ffn.params.values()} == {"R"}
    assert any(
        "MptMLP) is kept whole on tp: its forward takes a second activation 'residual'" in n
        for n in p.notes
    ), p.notes
    assert plan(build_family("mpt", seed=0), "tp=1")  # nothing sharded: nothing to declare
