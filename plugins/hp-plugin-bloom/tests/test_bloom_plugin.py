"""hp-plugin-bloom: with it BLOOM matches one device on tp.

Discovery, provenance, isolation and the public surface are the conformance suite's
(``test_bloom_conformance.py``).

The distributed tests spawn real gloo worlds once (``hp_core.testing.get_world``) and run
the tasks of ``dist_tasks_bloom`` (next to this file) on every rank.
"""

from __future__ import annotations

import copy
import importlib.metadata
from pathlib import Path

import dist_tasks_bloom as tasks
import pytest
import torch
from hp_plugin_bloom.alibi import HeadSlicedAttention, bloom_alibi_heads
from hp_plugin_bloom.local_region import BloomTensorParallelError, tp_position
from hp_plugin_bloom.plugin import ARCHITECTURE, BLOOM_ROLE_RULES, BLOOM_TEMPLATES
from transformers import BloomConfig
from transformers.models.bloom.modeling_bloom import BloomAttention, build_alibi_tensor

from hp_core import ParallelContext, Role, plan, verify
from hp_core.testing import get_world

HERE = Path(__file__).resolve().parent.parent
TOL = 1e-5


@pytest.fixture
def _fresh(hp_plugins):
    """Fresh discovery (hp's plugin sandbox); the entry point made visible with a dist-info
    folder when the distribution is not pip-installed (importlib.metadata reads either the
    same way)."""
    try:
        importlib.metadata.distribution("hp-plugin-bloom")
    except importlib.metadata.PackageNotFoundError:
        hp_plugins.install_path(
            HERE / "src", dist="hp-plugin-bloom", entry_point="hp_plugin_bloom.plugin"
        )
    return hp_plugins


def _tiny(heads: int = 4) -> BloomConfig:
    return BloomConfig(vocab_size=32, hidden_size=32, n_layer=1, n_head=heads, hidden_dropout=0.0)


# ------------------------------------------------------------------ discovery and rules


def test_rules_and_templates_are_scoped_to_bloom():
    assert {rule.architectures for rule in BLOOM_ROLE_RULES} == {(ARCHITECTURE,)}
    assert {t.architectures for t in BLOOM_TEMPLATES} == {(ARCHITECTURE,)}
    assert [t.name for t in BLOOM_TEMPLATES] == ["bloom.attention", "bloom.mlp", "bloom.norm"]


def test_rules_classify_a_real_bloom_model():
    with torch.device("meta"):
        from transformers import BloomForCausalLM

        model = BloomForCausalLM(_tiny())
    expected = {
        "query_key_value": Role.COLWISE,
        "self_attention.dense": Role.ROWWISE,
        "dense_h_to_4h": Role.COLWISE,
        "dense_4h_to_h": Role.ROWWISE,
        "layernorm": Role.NORM,
        "ln_f": Role.NORM,
    }
    seen = set()
    for fqn, _ in model.named_parameters():
        matching = [r.role for r in BLOOM_ROLE_RULES if r.matches(fqn, (ARCHITECTURE,))]
        key = next((k for k in expected if f"{k}." in fqn), None)
        assert matching == ([expected[key]] if key else []), fqn
        seen.add(key)
        # scoped: another architecture's parameters of the same names are not claimed
        assert not any(r.matches(fqn, ("LlamaForCausalLM",)) for r in BLOOM_ROLE_RULES)
    assert seen - {None} == set(expected)


# ------------------------------------------------------------------ planning and verifying


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_plan_and_verifier_in_one_process(_fresh, sp):
    """The plan the templates build, proven by the verifier on meta copies over a fake
    process group (the validate copy runs the wrappers on DTensors, production on shards)."""
    from transformers import BloomForCausalLM

    with torch.device("meta"):
        model = BloomForCausalLM(_tiny())
    p = plan(model, "tp=2", sequence_parallel=sp)
    hidden = "S(1)" if sp else "R"
    attn, mlp = p["transformer.h.0.self_attention"], p["transformer.h.0.mlp"]
    assert (attn.inner_wrapper, mlp.inner_wrapper) == ("bloom_alibi_heads", "bloom_residual_once")
    assert {k: str(v["tp"]) for k, v in attn.in_src.items()} == {
        "hidden_states": hidden,
        "residual": hidden,
    }
    assert {k: str(v["tp"]) for k, v in mlp.in_dst.items()} == {
        "hidden_states": "R",
        "residual": "R",
    }
    assert str(attn.out_src["output"]["tp"]) == "P(sum)"
    assert str(attn.params["query_key_value.weight"]["tp"]) == "S(0)"
    assert str(mlp.params["dense_4h_to_h.weight"]["tp"]) == "S(1)"
    # the embedding's LayerNorm sees the embedding's output, whole on tp
    embed_norm = p["transformer.word_embeddings_layernorm"]
    assert str(embed_norm.in_src["input"]["tp"]) == "R"
    assert str(p["transformer.ln_f"].in_src["input"]["tp"]) == hidden
    report = verify(model, p, "tp=2")
    # the wrapped regions are checked by DTensor propagation, not left opaque
    for fqn in ("transformer.h.0.self_attention", "transformer.h.0.mlp"):
        assert fqn in report.checked and fqn not in report.opaque, (report.checked, report.opaque)


# ------------------------------------------------------------------ the wrapper, one process


def _sharded_copy(attn: BloomAttention, rank: int, size: int) -> BloomAttention:
    """What rank ``rank`` of ``size`` holds in production: a row block of query_key_value,
    a column block of dense (its bias added once, after the reduction), local num_heads."""
    part = copy.deepcopy(attn)
    rows = attn.query_key_value.weight.shape[0] // size
    cols = attn.dense.weight.shape[1] // size
    with torch.no_grad():
        part.query_key_value.weight = torch.nn.Parameter(
            attn.query_key_value.weight[rank * rows : (rank + 1) * rows].clone()
        )
        part.query_key_value.bias = torch.nn.Parameter(
            attn.query_key_value.bias[rank * rows : (rank + 1) * rows].clone()
        )
        part.dense.weight = torch.nn.Parameter(
            attn.dense.weight[:, rank * cols : (rank + 1) * cols].clone()
        )
        part.dense.bias = None
    part.num_heads = attn.num_heads // size
    return part


def _split_attention(size: int, rows: str = "heads") -> tuple[float, torch.Tensor]:
    torch.manual_seed(0)
    attn = BloomAttention(_tiny(heads=4), layer_idx=0)
    batch, seq = 2, 8
    x, residual = torch.randn(batch, seq, 32), torch.randn(batch, seq, 32)
    mask = torch.ones(batch, seq, dtype=torch.long)
    alibi = build_alibi_tensor(mask, 4, torch.float32)
    causal = torch.triu(torch.full((seq, seq), float("-inf")), 1)[None, None]
    whole, _ = attn(x, residual, alibi, causal)
    total = torch.zeros_like(whole)
    for rank in range(size):
        fwd = HeadSlicedAttention(_sharded_copy(attn, rank, size), rank, size)
        if rows == "contiguous":  # what a Shard(0) of the bias would hand each rank
            fwd._rows = lambda a, b, t, h, r=rank: a[r * a.shape[0] // size :][: b * h]
        out, probs = fwd(x, residual, alibi, causal)
        assert probs.shape == (batch, 4 // size, seq, seq)
        total = total + out
    total = total + attn.dense.bias
    return float((total - whole).detach().abs().max()), whole.detach()


@pytest.mark.parametrize("size", [1, 2, 4])
def test_the_ranks_heads_with_their_alibi_rows_add_up_to_the_whole_attention(size):
    err, whole = _split_attention(size)
    assert err < 1e-5 * float(whole.abs().max()), err


def test_negative_control_contiguous_alibi_rows_give_another_attention():
    err, _ = _split_attention(2, rows="contiguous")
    assert err > 1e-3, err


def test_an_alibi_that_does_not_fit_the_shard_is_refused():
    attn = _sharded_copy(BloomAttention(_tiny(heads=4), layer_idx=0), 0, 2)
    attn._hp_fqn = "transformer.h.0.self_attention"
    fwd = HeadSlicedAttention(attn, 0, 2)
    x = torch.randn(2, 8, 32)
    alibi = torch.zeros(2 * 3, 1, 8)  # three heads' rows: not 2 ranks x 2 heads
    with pytest.raises(BloomTensorParallelError, match=r"transformer\.h\.0\.self_attention.*Fix:"):
        fwd(x, x, alibi, None)


def test_a_cp_mesh_is_refused_with_the_module_named():
    attn = BloomAttention(_tiny(), layer_idx=0)
    attn._hp_fqn = "transformer.h.1.self_attention"
    ctx = ParallelContext(axis_names=("cp",), sizes=(2,), cp_mesh=object())  # type: ignore[arg-type]
    with pytest.raises(BloomTensorParallelError, match=r"transformer\.h\.1\.self_attention.*cp=2"):
        tp_position(attn, ctx)
    assert tp_position(attn, ParallelContext(axis_names=("dp",), sizes=(2,))) == (0, 1)
    with pytest.raises(BloomTensorParallelError, match="Fix: plan BLOOM without a cp axis"):
        bloom_alibi_heads(attn, ctx)


# ------------------------------------------------------------------ real gloo worlds


def _matched(r: dict, tp: int) -> None:
    assert "refused" not in r, r
    bad = {k: v for k, v in r["excess"].items() if not v <= TOL}
    assert not bad, f"mismatches above {TOL}: {bad}"
    assert r["n_grads"] == 30 and not any(r["unmoved"].values()), r["unmoved"]
    assert r["collectives"] == 0, "the verifier issued a collective"
    assert r["qkv_rows"] == 3 * 64 // tp  # really sharded: this rank's heads only
    assert r["wrapped"] == [
        f"transformer.h.{i}.{m}" for i in (0, 1) for m in ("mlp", "self_attention")
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_tp2_matches_one_device_in_both_modes(sp):
    for r in get_world(2).run(tasks.bloom_case, 2, sp):
        _matched(r, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_tp4_with_eight_heads_matches_one_device_in_both_modes(sp):
    for r in get_world(4).run(tasks.bloom_case, 4, sp, n_head=8):
        _matched(r, 4)


@pytest.mark.distributed
def test_negative_control_without_the_alibi_slicing_the_logits_differ():
    """The same plan, each rank taking a contiguous chunk of the bias instead of its heads'
    rows: shapes fit, so only the comparison can catch it, in both modes."""
    for r in get_world(2).run(tasks.bloom_case, 2, True, control="contiguous_rows"):
        assert "refused" not in r, r
        for key in ("prod-ref:logits", "val-ref:logits", "prod-ref:grad", "val-ref:grad"):
            assert r["excess"][key] > 100 * TOL, (key, r["excess"])


@pytest.mark.distributed
def test_without_the_plugin_bloom_is_refused_naming_a_module():
    for r in get_world(2).run(tasks.bloom_case, 2, True, with_plugin=False):
        assert r.get("refused", "").endswith("Error"), r
        assert r["names_module"], r["message"]
