"""The plan verifier, in-process on meta-device models and a fake process group.

Each refusal is asserted with its type, the module it names and the fix it proposes; each
derived gradient reduction is asserted exactly. The distributed tests (test_matrix.py)
check that what the verifier accepts really matches a single device.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hp_core import HpError, ModuleShardingSpec, plan, verify
from hp_core.planner import head_search
from hp_core.runtime.partial import AmbiguousGradientError
from hp_core.runtime.vocab import VocabLookupError
from hp_core.testing.families import build_family
from hp_core.testing.printed_fix import printed_fix
from hp_core.verifier import (
    MixedGradientError,
    ProductionDiffersError,
    RandomOnPartialError,
    UndeclaredCommunicationError,
    UnverifiableError,
    VerificationError,
)
from hp_core.verifier.meta import MetaValues, meta_clone
from hp_core.verifier.repeats import find_repeats
from tests import _toy_models as toys
from tests._qk_norm_helpers import no_qk_norm_scheme  # noqa: F401  (fixture)


def meta(family: str, **config) -> nn.Module:
    return build_family(family, device="meta", **config)


def norms(layers: int) -> dict[str, tuple[str, ...]]:
    out = {}
    for i in range(layers):
        out[f"model.layers.{i}.input_layernorm.weight"] = ("tp",)
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = ("tp",)
    out["model.norm.weight"] = ("tp",)
    return out


def fix_from(message: str) -> list[dict]:
    """The overrides a refusal prints (checked by hp before it printed them)."""
    fix = printed_fix(message)
    assert fix is not None and not fix.flags, message
    return fix.overrides


# ------------------------------------------------------------------ what it derives


def test_sequence_parallel_norms_are_the_partial_gradients_of_llama():
    m = meta("llama")
    report = verify(m, plan(m, "tp=2"))
    assert report.partial() == norms(2)
    assert {r.source for r in report.reductions} == {"propagation"}
    assert "model.layers.0.self_attn" in report.checked and "model.embed_tokens" in report.checked
    assert not report.opaque


def test_without_sequence_parallel_no_gradient_of_llama_is_partial():
    m = meta("llama")
    assert verify(m, plan(m, "tp=2", sequence_parallel=False)).reductions == ()


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_per_head_qk_norms_are_partial_with_and_without_sequence_parallel(sp):
    """Qwen3's q_norm/k_norm see only this rank's heads: partial even without SP (no list names
    them)."""
    m = meta("qwen3")
    got = verify(m, plan(m, "tp=2", sequence_parallel=sp)).partial()
    heads = {f"model.layers.{i}.self_attn.{n}_norm.weight": ("tp",) for i in range(2) for n in "qk"}
    assert got == ({**norms(2), **heads} if sp else heads)


def test_deferred_rowwise_biases_are_partial_only_under_sequence_parallel():
    m = meta("llama", attention_bias=True, mlp_bias=True)
    sp = verify(m, plan(m, "tp=2")).partial()
    assert sp["model.layers.0.self_attn.o_proj.bias"] == ("tp",) and sp[
        "model.layers.1.mlp.down_proj.bias"
    ] == ("tp",)
    no_sp = verify(m, plan(m, "tp=2", sequence_parallel=False)).partial()
    assert not any(n.endswith(("o_proj.bias", "down_proj.bias")) for n in no_sp)


def test_context_parallel_makes_every_parameter_partial_on_cp():
    m = meta("llama")
    p = plan(
        m,
        "cp=2",
        overrides=[
            {
                "match": "*.self_attn",
                "when": "cp",
                "inner_target": "self",
                "inner_wrapper": "sdpa_hf",
                "region_dispatch": False,
            }
        ],
    )
    got = verify(m, p).partial()
    assert set(got) == {n for n, _ in m.named_parameters()}
    assert set(got.values()) == {("cp",)}


def test_moe_experts_replicated_on_tp_follow_the_contract_under_sp():
    m = meta("qwen2_moe")
    report = verify(m, plan(m, "tp=2"))
    expert = "model.layers.0.mlp.experts.gate_up_proj"
    assert report.partial()[expert] == ("tp",)
    assert next(r for r in report.reductions if r.param == expert).source == "contract"
    assert "model.layers.0.mlp" in report.opaque


def test_gemma_scaled_embedding_keeps_its_scale_and_verifies():
    m = meta("gemma")
    report = verify(m, plan(m, "tp=2"))
    assert "model.embed_tokens" in report.checked  # the subclass forward ran, on DTensors


def test_repeated_layers_are_checked_once_and_give_the_same_answer():
    m = meta("llama", num_hidden_layers=5)
    p = plan(m, "tp=2")
    quick = verify(m, p)
    full = verify(m, p, exhaustive=True)
    # layer 0 is distinct under SP (its input arrives whole); layers 2-4 repeat layer 1
    assert quick.repeated == {f"model.layers.{i}": "model.layers.1" for i in (2, 3, 4)}
    assert full.repeated == {}
    assert quick.partial() == full.partial() == norms(5)


def test_an_index_attribute_may_differ_but_nothing_else():
    m = meta("llama", num_hidden_layers=3)
    p = plan(m, "tp=2")
    assert find_repeats(m, p.modules) == {"model.layers.2": "model.layers.1"}  # layer_idx differs
    m.model.layers[2].self_attn.scaling = 0.5  # a real difference
    assert find_repeats(m, p.modules) == {}


# ------------------------------------------------------------------ what it refuses


@pytest.mark.usefixtures("no_qk_norm_scheme")  # the planner as before it sharded such norms
def test_full_width_qk_norm_on_sharded_projections_is_refused_with_a_fix_that_verifies():
    m = meta("olmo2")
    with pytest.raises(
        UndeclaredCommunicationError, match=r"model\.layers\.0\.self_attn \(Olmo2Attention\)"
    ) as e:
        verify(m, plan(m, "tp=2"))
    assert e.value.suspects == ("q_norm.weight", "k_norm.weight")  # named in the message too
    assert "next to sharded parameters: q_norm.weight, k_norm.weight" in str(e.value)
    fix = fix_from(str(e.value))
    # one entry for the same block in every layer (they share the contract), pasted as is
    assert fix[0]["match"] == "model.layers.*.self_attn" and fix[0]["params"]["q_proj.weight"] == {
        "tp": "replicate"
    }
    verify(m, plan(m, "tp=2", overrides=fix))


def _kept_whole(m: nn.Module, *rels: str) -> list[dict]:
    """The zero-config attention plan with ``rels`` replicated (the planner shards them)."""
    params = dict(plan(m, "tp=2")["model.layers.0.self_attn"].params)
    params.update({rel: {"tp": "replicate"} for rel in rels})
    return [{"match": "model.layers.*.self_attn", "params": params}]


def test_per_head_tensor_kept_whole_while_heads_split_is_refused():
    m = meta("cohere")  # q_norm/k_norm weights [heads, head_dim]
    with pytest.raises(UndeclaredCommunicationError, match="CohereAttention"):
        verify(m, plan(m, "tp=2", overrides=_kept_whole(m, "q_norm.weight", "k_norm.weight")))


def test_attention_sinks_kept_whole_are_refused():
    m = meta("gpt_oss")
    with pytest.raises(UndeclaredCommunicationError, match="GptOssAttention"):
        verify(m, plan(m, "tp=2", overrides=_kept_whole(m, "sinks")))


def test_mla_projection_left_replicated_next_to_sharded_ones_is_refused():
    m = meta("deepseek_v2")
    with pytest.raises(UndeclaredCommunicationError, match="DeepseekV2Attention"):
        verify(m, plan(m, "tp=2", overrides=_kept_whole(m, "kv_b_proj.weight")))


def test_dropout_on_a_partial_sum_is_refused_and_p_zero_is_not():
    torch.manual_seed(0)
    with torch.device("meta"):
        m = toys.dropout_mlp_lm(0.1)
    with pytest.raises(
        RandomOnPartialError, match=r"model\.layers\.0\.mlp \(DropoutMLP\).*partial sum"
    ):
        verify(m, plan(m, "tp=2"))
    with torch.device("meta"):
        m0 = toys.dropout_mlp_lm(0.0)
    verify(m0, plan(m0, "tp=2"))


def test_a_width_the_plan_does_not_divide_fails_in_production_and_is_refused(monkeypatch):
    with torch.device("meta"):
        m = toys.local_width_lm()
    # The planner's head search finds the width (and the verifier agrees) ...
    found = plan(m, "tp=2")
    assert "inner_width" in found["model.layers.0.self_attn"]._tp_local_attr_plan
    verify(m, found)
    # ... without it, production's program fails on the shards and the verifier refuses it.
    monkeypatch.setattr(head_search, "search_local_attrs", lambda *a, **k: None)
    with pytest.raises(
        ProductionDiffersError,
        match=r"(?s)model\.layers\.0\.self_attn \(LocalWidthAttention\).*tp_divide_attrs",
    ):
        verify(m, plan(m, "tp=2"))
    fixed = plan(
        m,
        "tp=2",
        overrides={"model.layers.0.self_attn": ModuleShardingSpec(tp_divide_attrs=["inner_width"])},
    )
    verify(m, fixed)


class Indexed(nn.Embedding):
    def forward(self, input):
        return self.weight[input]


def test_an_embedding_whose_forward_never_looks_up_its_weight_is_refused():
    m = meta("llama")
    m.model.embed_tokens.__class__ = Indexed
    # DTensor sees the whole-vocabulary indexing of a vocabulary shard
    with pytest.raises(
        UndeclaredCommunicationError, match=r"model\.embed_tokens \(Indexed\).*aten\.index"
    ):
        verify(m, plan(m, "tp=2"))


def test_production_refuses_a_lookup_it_cannot_make_vocab_parallel():
    from hp_core.runtime.vocab import VocabParallelLookup
    from hp_core.verifier.inputs import verification_mesh as _verification_mesh

    emb = Indexed(8, 4)
    with _verification_mesh(plan(meta("llama"), "tp=2"), "tp=2") as mesh:
        lookup = VocabParallelLookup("emb", emb, emb.forward, mesh, "tp", "production")
        with pytest.raises(
            VocabLookupError,
            match=r"emb: the forward of Indexed never called torch\.nn\.functional\.embedding",
        ):
            lookup(torch.zeros(2, 3, dtype=torch.long))


def test_a_replicated_parameter_next_to_sharded_ones_in_local_code_is_refused():
    m = meta("qwen3")
    p = plan(m, "tp=2", overrides=[{"match": "*.self_attn", "region_dispatch": False}])
    with pytest.raises(
        AmbiguousGradientError, match=r"self_attn\.q_norm\.weight: kept whole on 'tp' in a block"
    ) as e:
        verify(m, p)
    fix = printed_fix(str(e.value))  # keeping the attention whole, checked by hp
    assert fix is not None and fix.overrides[0]["match"] == "model.layers.*.self_attn", e.value


def test_a_tied_weight_with_a_whole_and_a_partial_gradient_is_refused():
    m = meta("llama")
    m.model.norm.weight = m.model.layers[0].input_layernorm.weight
    keep_final_norm_whole = {
        "model.norm": ModuleShardingSpec(
            in_dst={"hidden_states": {"tp": torch.distributed.tensor.Replicate()}},
            out_src={"output": {"tp": torch.distributed.tensor.Replicate()}},
        )
    }
    with pytest.raises(MixedGradientError, match=r"model\.layers\.0\.input_layernorm\.weight"):
        verify(m, plan(m, "tp=2", overrides=keep_final_norm_whole))


def test_a_parameter_outside_every_boundary_is_judged_by_the_layouts_around_it():
    with torch.device("meta"):
        m = toys.PositionEmbeddingLM()
    wpe = {
        "wpe": ModuleShardingSpec(
            is_boundary=False, params={"weight": {"tp": torch.distributed.tensor.Replicate()}}
        )
    }
    # without SP every activation between boundaries is whole on tp: its gradient is whole
    report = verify(m, plan(m, "tp=2", sequence_parallel=False, overrides=wpe))
    assert "wpe.weight" not in report.partial()
    # under SP some are sharded and some whole: hp cannot tell which it meets
    with pytest.raises(
        AmbiguousGradientError, match=r"wpe\.weight: its module runs outside every boundary"
    ):
        verify(m, plan(m, "tp=2", overrides=wpe))


def test_every_refusal_is_an_hp_error_and_a_value_error():
    for cls in (
        UndeclaredCommunicationError,
        RandomOnPartialError,
        ProductionDiffersError,
        AmbiguousGradientError,
        VocabLookupError,
    ):
        assert issubclass(cls, HpError) and issubclass(cls, ValueError)
    assert issubclass(VerificationError, HpError)


# ------------------------------------------------------------------ running it


def test_a_plan_without_sizes_needs_a_mesh():
    m = meta("llama")
    p = plan(m, "tp=2")
    import dataclasses

    with pytest.raises(UnverifiableError, match="pass the mesh sizes"):
        verify(m, dataclasses.replace(p, mesh_shape=None))
    assert verify(m, dataclasses.replace(p, mesh_shape=None), "tp=2").partial() == norms(2)


def test_a_model_whose_inputs_cannot_be_guessed_needs_them():
    class NoIds(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(8, 16)

        def forward(self, x):
            return self.up(x)

    with torch.device("meta"):
        m = NoIds()
    p = plan(
        m,
        "tp=2",
        overrides={
            "up": ModuleShardingSpec(
                params={
                    "weight": {"tp": torch.distributed.tensor.Shard(0)},
                    "bias": {"tp": torch.distributed.tensor.Shard(0)},
                },
                in_src={"input": {"tp": torch.distributed.tensor.Replicate()}},
                in_dst={"input": {"tp": torch.distributed.tensor.Replicate()}},
                out_src={"output": {"tp": torch.distributed.tensor.Shard(1)}},
                out_dst={"output": {"tp": torch.distributed.tensor.Shard(1)}},
            )
        },
    )
    with pytest.raises(UnverifiableError, match=r"cannot guess what NoIds\.forward takes"):
        verify(m, p)
    report = verify(m, p, inputs=((torch.ones(2, 8),), {}))
    assert report.checked == ("up",)


def test_the_verifier_leaves_the_model_untouched():
    m = build_family("llama")
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    forwards = [vars(mod).get("forward") for mod in m.modules()]
    verify(m, plan(m, "tp=2"))
    assert all(torch.equal(before[n], p) for n, p in m.named_parameters())
    assert forwards == [vars(mod).get("forward") for mod in m.modules()]
    assert not any(p.is_meta for p in m.parameters())


def test_meta_clone_shares_repeats_and_keeps_ties():
    m = build_family("llama", num_hidden_layers=3, tie_word_embeddings=True)
    clone = meta_clone(m, {"model.layers.2": "model.layers.1"})
    assert (
        clone.model.layers[2] is clone.model.layers[1]
        and clone.model.layers[1] is not m.model.layers[1]
    )
    assert clone.lm_head.weight is clone.model.embed_tokens.weight
    assert all(p.is_meta for p in clone.parameters()) and all(b.is_meta for b in clone.buffers())


def test_meta_values_answer_data_dependent_questions_neutrally():
    x = torch.empty(3, 4, device="meta")
    with MetaValues():
        assert bool((x > 0).all()) is True
        assert bool((x > 0).any()) is False
        assert int(x.sum()) == 0
        assert tuple((x > 0).nonzero().shape) == (12, 2)
        assert torch.equal(x, x)


def test_model_code_that_fails_on_production_attributes_is_refused():
    with torch.device("meta"):
        m = toys.HeadCountReader()
    with pytest.raises(
        ProductionDiffersError, match="production mode fails outside every boundary"
    ):
        verify(m, plan(m, "tp=2", sequence_parallel=False))


def test_the_report_summarizes_what_was_proven():
    m = meta("qwen2_moe", num_hidden_layers=3)
    report = verify(m, plan(m, "tp=2"))
    text = report.summary()
    assert text.startswith("verified on mesh {'tp': 2} in ")
    assert (
        "partial gradients summed over tp: " in text
        and "not looked into: model.layers.0.mlp" in text
    )
    # Layer 0 (entered from the embedding) and layer 1 are proven; layer 2 repeats layer 1.
    assert report.repeated == {"model.layers.2": "model.layers.1"}
    assert "1 repeated layers skipped" in text


@pytest.mark.parametrize(
    "given,expected",
    [
        ({"input_ids": torch.ones(2, 4, dtype=torch.long)}, ((), {"input_ids": (2, 4)})),
        (((torch.ones(2, 4, dtype=torch.long),), {}), (((2, 4),), {})),
        ([torch.ones(2, 4, dtype=torch.long)], (((2, 4),), {})),
        (torch.ones(2, 4, dtype=torch.long), (((2, 4),), {})),
    ],
    ids=["dict", "args-kwargs", "list", "tensor"],
)
def test_given_inputs_become_meta_tensors_of_the_same_shape(given, expected):
    from hp_core.verifier.inputs import to_meta_inputs as _to_meta_inputs

    args, kwargs = _to_meta_inputs(given)
    assert all(t.is_meta for t in (*args, *kwargs.values()))
    assert (
        tuple(tuple(t.shape) for t in args),
        {k: tuple(v.shape) for k, v in kwargs.items()},
    ) == expected


def test_a_fake_group_cannot_start_inside_a_real_one():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    m = meta("llama")
    p = plan(m, "tp=2")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(UnverifiableError, match="a process group is already initialized"):
            verify(m, p, "tp=2")
    finally:
        dist.destroy_process_group()


def test_an_input_that_arrives_in_another_layout_than_declared_is_refused():
    """The final norm says its input arrives whole; under SP it arrives sequence-sharded."""
    from torch.distributed.tensor import Replicate

    from hp_core.verifier import LayoutMismatchError

    m = meta("llama")
    whole = {"hidden_states": {"tp": Replicate()}}
    with pytest.raises(
        LayoutMismatchError,
        match=r"model\.norm: its input 'hidden_states' arrives with local shape \(2, 8, 64\)",
    ):
        verify(
            m,
            plan(m, "tp=2", overrides=[{"match": "model.norm", "in_src": whole, "in_dst": whole}]),
        )


def test_the_cross_run_checks_name_what_differs():
    from torch.distributed.tensor import Partial, Replicate

    from hp_core.verifier import InputGradientError, LayoutMismatchError, ProductionDiffersError
    from hp_core.verifier.consistency import (
        arrival_check,
        check_input_gradients,
        check_layouts,
        check_modes_agree,
    )
    from hp_core.verifier.probes import BoundaryRecord

    m = meta("llama")
    p = plan(m, "tp=2")
    fqn = "model.layers.0.self_attn"
    val, prod = (
        BoundaryRecord(fqn, True, shapes=[((2, 16, 64),)]),
        BoundaryRecord(fqn, False, shapes=[((2, 8, 64),)]),
    )
    with pytest.raises(
        ProductionDiffersError,
        match=r"model\.layers\.0\.self_attn: production mode produces local output shapes",
    ):
        check_modes_agree({fqn: val}, {fqn: prod})
    plain = BoundaryRecord(
        fqn, False, shapes=[((2, 16, 64),)], inputs=[{"hidden_states": (2, 16, 64)}]
    )
    right = BoundaryRecord(
        fqn, False, shapes=[((2, 8, 64),)], inputs=[{"hidden_states": (2, 8, 64)}]
    )
    check_layouts(
        {fqn: plain}, {fqn: right}, p, {"tp": 2}
    )  # in and out sequence-sharded, as declared
    whole_out = BoundaryRecord(
        fqn, False, shapes=[((2, 16, 64),)], inputs=[{"hidden_states": (2, 8, 64)}]
    )
    with pytest.raises(
        LayoutMismatchError, match="its output 'attn_output' leaves with local shape"
    ):
        check_layouts({fqn: plain}, {fqn: whole_out}, p, {"tp": 2})
    whole_in = BoundaryRecord(
        fqn, False, shapes=[((2, 8, 64),)], inputs=[{"hidden_states": (2, 16, 64)}]
    )
    with pytest.raises(
        LayoutMismatchError, match="its input 'hidden_states' arrives with local shape"
    ):
        check_layouts({fqn: plain}, {fqn: whole_in}, p, {"tp": 2})
    with pytest.raises(
        LayoutMismatchError, match="its input 'hidden_states' arrives with local shape"
    ):
        arrival_check({fqn: plain}, p, {"tp": 2})(fqn, 0, {"hidden_states": (2, 16, 64)})
    # attention gathers its input and shards its projections: the input's gradient is partial
    partial = BoundaryRecord(fqn, True, input_grads={"hidden_states": [(("tp", Partial()),)]})
    check_input_gradients({fqn: partial}, p, ["tp"])
    whole = BoundaryRecord(fqn, True, input_grads={"hidden_states": [(("tp", Replicate()),)]})
    with pytest.raises(
        InputGradientError,
        match=r"model\.layers\.0\.self_attn: the gradient of its input 'hidden_states' is whole",
    ):
        check_input_gradients({fqn: whole}, p, ["tp"])


def test_meta_values_do_not_confuse_a_freed_tensor_with_a_new_one():
    """An ``all()`` answer is tied to its tensor, not to an id Python may hand out again."""
    x = torch.empty(3, device="meta")
    with MetaValues():
        for _ in range(50):
            assert bool((x > 0).all()) is True  # freed right after
            assert bool((x > 0).any()) is False  # may get the freed tensor's id


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_a_learned_activation_parameter_inside_a_sharded_mlp_is_partial(sp):
    """Its gradient sums over this rank's features only: partial on tp with or without SP."""
    with torch.device("meta"):
        m = toys.learned_activation_lm()
    assert verify(m, plan(m, "tp=2", sequence_parallel=sp)).partial()[
        "model.layers.0.mlp.beta"
    ] == ("tp",)


def test_a_report_saves_and_loads_and_refuses_edits():
    from hp_core import VerifyReport
    from hp_core.verifier.report import ReportFormatError

    m = meta("qwen3")
    report = verify(m, plan(m, "tp=2"))
    text = report.dumps()
    back = VerifyReport.loads(text)
    assert back.partial() == report.partial() and back.fingerprint == report.fingerprint
    assert VerifyReport.loads(back.dumps()).dumps() == text  # byte-stable
    with pytest.raises(ReportFormatError, match="signature does not match"):
        VerifyReport.loads(text.replace('"tp"]', '"cp"]', 1))
    with pytest.raises(ReportFormatError, match="not a verifier report"):
        VerifyReport.loads("{}")
    with pytest.raises(ReportFormatError, match="invalid JSON"):
        VerifyReport.loads("{")


def test_a_model_loaded_with_hub_kernels_verifies():
    """transformers 5.25 loads models with ``use_kernels`` on; their ``train()`` re-kernelizes,
    which refuses the meta device. The verifier's copies enter training mode without it."""
    from kernels import Mode

    m = build_family("llama", seed=0)
    m._use_kernels, m._kernels_mode = True, Mode.INFERENCE  # what from_pretrained leaves
    m.eval()
    with pytest.raises(ValueError, match="Unsupported device type 'meta'"):
        meta_clone(m).train()  # the negative control: HF's own train() on a meta copy
    report = verify(m, plan(m, "tp=2"))
    assert report.reductions and m.training is False  # the model itself is not touched
