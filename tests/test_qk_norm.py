"""Full-width q/k norms (OLMo-2, OLMo-3, OLMoE): sharded with the heads, exact, counted.

Planning runs in-process on meta models; the equivalence runs on real gloo worlds: loss,
logits and every gradient over 2 AdamW steps match one device in both modes, and the
collectives one step issues are exactly what the plan predicts — one all-reduce per norm
each way more than the projections alone.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from hp_core import cli, plan, verify
from hp_core.artifact import freeze, plan_differences, rebuild, same_plan
from hp_core.injection import Target
from hp_core.planner.sharded_norm import (
    SHARDED_QK_NORM,
    ShardedNormError,
    _GlobalFeatureMean,
    _grad_placements,
    _ShardedNorm,
    norm_collectives,
    sharded_qk_norm,
)
from hp_core.planner.templates import builtin
from hp_core.plans.prediction import step_collectives
from hp_core.testing import get_world
from hp_core.testing.families import build_family, tiny_family_config
from tests import dist_tasks_qk_norm as tasks
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)
from tests.test_error_style import style_problems

TOL = 1e-5
ATTN = "model.layers.0.self_attn"
FULL_WIDTH = ["olmo2", "olmo3", "olmoe"]


def meta(family: str, **kw):
    return build_family(family, device="meta", **kw)


# ----------------------------------------------------------------------- planning


@pytest.mark.usefixtures("builtin_only")
@pytest.mark.parametrize("family", FULL_WIDTH)
def test_full_width_norms_are_sharded_with_the_heads(family):
    model = meta(family)
    spec = plan(model, "tp=2")[ATTN]
    attn = model.get_submodule(ATTN)
    assert spec.params["q_norm.weight"] == {"tp": Shard(0)}
    assert spec.params["k_norm.weight"] == {"tp": Shard(0)}
    assert spec.params["q_proj.weight"] == {"tp": Shard(0)}
    widths = {"q_norm": attn.q_proj.out_features, "k_norm": attn.k_proj.out_features}
    assert spec.inner_wrapper == Target(SHARDED_QK_NORM, {"norms": widths})
    assert spec.inner_target == "self" and spec.region_dispatch is True
    # the widths are the projections' full outputs, not one head's
    assert all(w > attn.head_dim for w in widths.values())


@pytest.mark.usefixtures("builtin_only")
def test_per_head_norms_keep_their_plan(monkeypatch):
    """Qwen3's q/k norms span one head (head_dim): replicated, no wrapper, same plan as before."""
    p = plan(meta("qwen3"), "tp=2")
    spec = p[ATTN]
    assert spec.params["q_norm.weight"] == {"tp": Replicate()}
    assert spec.inner_wrapper is None and spec.region_dispatch is None
    olmo = plan(meta("olmo2"), "tp=2")
    monkeypatch.setattr(builtin, "shard_full_width_norms", lambda ctx, spec: spec)
    assert plan(meta("qwen3"), "tp=2").fingerprint() == p.fingerprint()
    # the patch takes the scheme away where it applies (so the comparison above means something)
    assert plan(meta("olmo2"), "tp=2").fingerprint() != olmo.fingerprint()


@pytest.mark.usefixtures("builtin_only")
@pytest.mark.parametrize("mesh", ["tp=1", "tp=2,cp=2", "cp=2"])
def test_no_scheme_without_tp_or_under_cp(mesh):
    """Without a tp split there is nothing to reduce; under cp the wrapper slot is CP's."""
    spec = plan(meta("olmo2"), mesh)[ATTN]
    assert spec.inner_wrapper is None
    assert not isinstance((spec.params.get("q_norm.weight") or {}).get("tp"), Shard)


@pytest.mark.usefixtures("builtin_only")
def test_explain_and_prediction_count_one_all_reduce_per_norm_each_way():
    p = plan(meta("olmo2"), "tp=2")
    text = p.explain()
    assert (
        "inner_wrapper=sharded_qk_norm(norms={'q_norm': 64, 'k_norm': 32}), inner_target=self, "
        "region_dispatch=true"
    ) in text
    assert (
        "collectives per call of inner wrapper 'sharded_qk_norm': forward all_reduce on tp x2, "
        "backward all_reduce on tp x2"
    ) in text
    with_items = step_collectives(p.modules, sizes={"tp": 2})
    without = step_collectives(p.modules)
    layers = 2
    assert with_items - without == {
        ("forward", "all_reduce", "tp"): 2 * layers,
        ("backward", "all_reduce", "tp"): 2 * layers,
    }
    assert norm_collectives({"tp": 1}, {"norms": {"q_norm": 64}}) == []


@pytest.mark.usefixtures("builtin_only")
def test_the_plan_freezes_and_rebuilds_with_its_norm_widths():
    p = plan(meta("olmoe"), "tp=2")
    again = rebuild(freeze(p))
    assert same_plan(p, again), plan_differences(p, again)
    assert again[ATTN].inner_wrapper == p[ATTN].inner_wrapper


@pytest.mark.usefixtures("builtin_only")
@pytest.mark.parametrize(
    ("family", "mesh", "extra"),
    [
        ("olmo2", "tp=2", {}),
        ("olmo3", "tp=2", {}),
        ("olmoe", "tp=2", {}),
        ("olmo2", "tp=4", {"num_key_value_heads": 4}),
    ],
)
def test_the_verifier_accepts_the_plan(family, mesh, extra):
    """Both modes' code runs on meta copies: no undeclared redistribution, matching shapes."""
    m = meta(family, **extra)
    report = verify(m, plan(m, mesh))
    assert report.partial()  # the sequence-parallel norms' gradients, as for any model
    # the sharded norms' gradients are whole on every rank: each holds its own heads' rows
    assert not [name for name in report.partial() if "q_norm" in name or "k_norm" in name]


@pytest.mark.usefixtures("builtin_only")
def test_hp_plan_verifies_a_config_and_prints_the_norm_collectives(capsys, tmp_path):
    tiny_family_config("olmo3").save_pretrained(tmp_path)
    code = cli.main(["plan", "--model", str(tmp_path), "--mesh", "tp=2", "--verify"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert "collectives per call of inner wrapper 'sharded_qk_norm'" in out
    assert "\n\nverified on mesh {'tp': 2} in " in out


def test_a_norm_that_is_not_a_submodule_is_refused_by_name():
    attn = meta("olmo2").get_submodule(ATTN)
    attn._hp_fqn = ATTN
    ctx = types.SimpleNamespace(tp_mesh=object())
    with pytest.raises(ShardedNormError) as e:
        sharded_qk_norm(attn, ctx, {"q_nrom": 64})
    assert "'q_nrom'" in str(e.value)
    assert style_problems(str(e.value), ATTN) == [], str(e.value)


def test_without_tp_the_module_keeps_its_forward():
    attn = meta("olmo2").get_submodule(ATTN)
    ctx = types.SimpleNamespace(tp_mesh=None)
    assert sharded_qk_norm(attn, ctx, {"q_norm": 64}) == attn.forward
    assert sharded_qk_norm(attn, types.SimpleNamespace(tp_mesh=object())) == attn.forward


# ------------------------------------------------------------------ distributed

pytestmark_dist = pytest.mark.distributed

CASES = [
    pytest.param("olmo2", 2, True, 1, id="olmo2-tp2-sp"),
    pytest.param("olmo3", 2, False, 1, id="olmo3-tp2-nosp"),
    pytest.param("olmoe", 2, True, 1, id="olmoe-tp2-sp"),
    pytest.param("olmoe", 2, True, 2, id="olmoe-tp2-sp-ep2"),
    pytest.param("olmo2", 4, False, 1, id="olmo2-tp4-nosp"),
]


@pytestmark_dist
@pytest.mark.parametrize(("family", "tp", "sp", "ep"), CASES)
def test_matches_one_device_with_the_predicted_collectives(family, tp, sp, ep):
    results = get_world(tp).run(tasks.qk_norm_case, family, tp, sp, ep)
    for r in results:
        bad = {k: v for k, v in r["excess"].items() if not v <= TOL}
        assert not bad, f"mismatches above {TOL}: {bad}"
        assert r["n_grads"] > 0 and not any(r["unmoved"].values()), r["unmoved"]
        assert r["verify_collectives"] == 0
        assert r["norm_layouts"] == {"q_norm.weight": "S(0)", "k_norm.weight": "S(0)"}
        assert r["local_norm_shape"][0] * tp == build_width(family, tp)
        # exactly what the plan predicts, in both modes
        assert r["measured"]["prod"] == r["predicted"], (r["measured"], r["predicted"])
        assert r["measured"]["val"] == r["predicted"], (r["measured"], r["predicted"])
        per_pass = {"all_reduce": 2 * r["layers"]}  # q_norm and k_norm in every layer
        assert r["norm_calls"] == {"forward": per_pass, "backward": per_pass}


def build_width(family: str, tp: int) -> int:
    model = meta(family, **({"num_key_value_heads": 4} if tp == 4 else {}))
    return model.get_submodule(ATTN).q_proj.out_features


@pytestmark_dist
def test_a_local_only_norm_on_the_shard_is_caught_by_the_comparison():
    """Negative control: production's norms normalize their shard alone (no reduction)."""
    (r, _) = get_world(2).run(tasks.qk_norm_case, "olmo2", 2, True, 1, "local_norm")
    assert r["removed"] == 2 * r["layers"]
    assert r["excess"]["prod-ref:logits"] > 1e-3 and r["excess"]["prod-ref:grad"] > 1e-3
    assert r["excess"]["val-ref:logits"] <= TOL  # validate kept the honest norms
    # the missing all-reduces are exactly the norms' share of the prediction
    for phase in ("forward", "backward"):
        missing = r["predicted"][phase]["all_reduce"] - r["measured"]["prod"][phase]["all_reduce"]
        assert missing == r["norm_calls"][phase]["all_reduce"]


# ------------------------------------------------------------ the norm's pieces


def test_a_norm_without_a_feature_mean_is_refused_by_name():
    """A 'norm' whose forward takes no mean over the feature dim (F.layer_norm) is refused."""
    ln = nn.LayerNorm(8)
    norm = _ShardedNorm(f"{ATTN}.q_norm", ln, ln.forward, 16, None)
    with pytest.raises(ShardedNormError) as e:
        norm(torch.randn(2, 3, 8))
    assert "took 0" in str(e.value)
    assert style_problems(str(e.value), f"{ATTN}.q_norm (LayerNorm)") == [], str(e.value)


def test_a_norm_that_sees_its_whole_width_runs_unchanged():
    """Kept whole on tp (an override replicating the projections): no reduction at all."""
    ln = nn.LayerNorm(8)
    x = torch.randn(2, 3, 8)
    out = _ShardedNorm(f"{ATTN}.q_norm", ln, ln.forward, 8, None)(x)
    assert torch.equal(out, ln(x))


def test_only_one_mean_over_the_feature_dim_is_made_global():
    mode = _GlobalFeatureMean(8, None)
    x = torch.randn(2, 3, 8)
    assert mode._feature_mean((x, -1), {})
    assert mode._feature_mean((x,), {"dim": (2,)})
    assert not mode._feature_mean((x, 1), {})  # over the sequence
    assert not mode._feature_mean((x, [1, 2]), {})
    assert not mode._feature_mean((torch.randn(2, 3, 4), -1), {})  # another width
    assert not mode._feature_mean((3.0, -1), {})


def test_norm_gradients_are_partial_only_where_tokens_are_split():
    x = types.SimpleNamespace(placements=(Shard(1), Shard(2)), dim=lambda: 3)
    weight = types.SimpleNamespace(placements=(Replicate(), Shard(0)))
    assert _grad_placements(weight, x) == (Partial(), Shard(0))  # cp splits tokens
    whole = types.SimpleNamespace(placements=(Replicate(), Shard(2)), dim=lambda: 3)
    assert _grad_placements(weight, whole) == (Replicate(), Shard(0))


@pytestmark_dist
def test_the_norm_keeps_the_modules_own_dtype_semantics():
    """bf16 in: OLMo-2's norm returns bf16 and OLMoE's fp32, sharded exactly as whole."""
    for r in get_world(2).run(tasks.norm_dtypes):
        assert r["olmo2"]["dtypes"] == ("torch.bfloat16", "torch.bfloat16")
        assert r["olmoe"]["dtypes"] == ("torch.float32", "torch.float32")
        for family in ("olmo2", "olmoe"):
            assert r[family]["max_diff"] <= r[family]["ulp"], r[family]
