"""The differential-test family matrix: every tiny family builds, trains and is seeded.

In-process and fast: each family is built once per session (``_model``), the other builds
are ~10 ms each.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from hp_core.testing.families import build_family, family_batch, tiny_family_config
from hp_core.testing.family_matrix import FAMILIES_MATRIX, FAMILY_NAMES, Family, UnknownFamilyError

REQUIRED = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "gemma",
    "gemma2", "gemma3", "olmo2", "olmoe", "deepseek_v2", "deepseek_v3", "gpt2", "gpt_neox",
    "falcon", "phi", "phi3", "glm4", "starcoder2", "cohere", "granite", "stablelm", "smollm3",
)  # fmt: skip
#: Issue 14's list: the required families plus these.
ISSUE_14 = (*REQUIRED, "olmo", "gpt_bigcode", "opt", "mpt", "bloom")

#: Families with 3 layers, not 2: one mixer per layer (Mamba-2, attention, MoE; lfm3's conv,
#: sliding and full attention), or a looped middle layer between a first and a last one.
THREE_LAYERS = ("nemotron_h", "inkling2_loop_text", "lfm3")
#: Attention-free families: their configs have no attention heads.
NO_HEADS = ("mamba", "falcon_mamba", "mamba2", "rwkv", "xlstm")
#: Parameters the causal-LM loss does not reach, by family: sparse-attention indexers pick
#: keys by top-k (HF trains them with a separate loss), so no gradient flows into them.
NO_LM_GRADIENT = {
    "deepseek_v32": ".self_attn.indexer.",
    "glm_moe_dsa": ".self_attn.indexer.",
    "axk2": ".self_attn.indexer.",
    "dots3_note_text": ".self_attn.indexer.",
    "hy_v4": ".self_attn.indexer.",
    "deepseek_v4": ".self_attn.compressor.indexer.",
    "qwen4_exp_text": ".self_attn.indexer.",
}


@functools.cache
def _model(name: str) -> nn.Module:
    """The default build of ``name`` (seed 0), shared by the tests that only read it."""
    return build_family(name)


def _floating(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p for k, p in model.named_parameters() if p.is_floating_point()}


# ----------------------------------------------------------------------------- the table


def test_table_holds_the_required_families_in_a_stable_order():
    missing = sorted(set(ISSUE_14) - set(FAMILY_NAMES))
    assert not missing, f"required families missing from the matrix: {missing}"
    assert len(FAMILY_NAMES) == len(set(FAMILY_NAMES)) >= len(ISSUE_14) == 30
    assert FAMILY_NAMES == tuple(FAMILIES_MATRIX)
    assert FAMILY_NAMES[: len(REQUIRED)] == REQUIRED
    for name, fam in FAMILIES_MATRIX.items():
        assert isinstance(fam, Family) and fam.name == name
        assert fam.notes and "\n" not in fam.notes, name
        assert fam.attn_implementation in {"sdpa", "eager"}, name
    assert FAMILIES_MATRIX["gemma3"].model_type == "gemma3_text"
    assert FAMILIES_MATRIX["gemma2"].attn_implementation == "eager"


def test_family_is_frozen_and_its_config_read_only():
    fam = FAMILIES_MATRIX["llama"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        fam.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        fam.config["hidden_size"] = 1  # type: ignore[index]
    hash(fam)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_config_has_the_tiny_shape(name):
    cfg = tiny_family_config(name)
    fam = FAMILIES_MATRIX[name]
    assert cfg.model_type == fam.model_type
    assert cfg._attn_implementation == fam.attn_implementation
    # hrm_text counts one layer slot per cycle: its stacks hold the layers
    layers = getattr(cfg, "num_layers_per_stack", None) or cfg.num_hidden_layers
    assert cfg.hidden_size == 64 and cfg.vocab_size == 128
    assert layers == (3 if name in THREE_LAYERS else 2)
    assert name in NO_HEADS or cfg.num_attention_heads == 4
    assert cfg.tie_word_embeddings is False
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert getattr(cfg, "pad_token_id", 0) == 0


def test_config_overrides_win_under_either_spelling_and_do_not_leak():
    assert tiny_family_config("gpt2", hidden_size=32).n_embd == 32
    assert tiny_family_config("gpt2", n_embd=32).hidden_size == 32
    assert tiny_family_config("qwen3_moe", num_local_experts=8).num_experts == 8
    assert tiny_family_config("llama", attn_implementation="eager")._attn_implementation == "eager"
    # The table is not mutated by a build (configs rewrite nested dicts in place).
    before = {k: repr(v) for k, v in FAMILIES_MATRIX["gemma3"].config.items()}
    deeper = tiny_family_config("gemma3", num_hidden_layers=4)
    assert deeper.layer_types == ["sliding_attention", "full_attention"] * 2  # pattern tiled
    assert tiny_family_config("smollm3", num_hidden_layers=3).no_rope_layers == [1, 0, 1]
    assert tiny_family_config("gpt2", num_hidden_layers=3).n_layer == 3
    assert {k: repr(v) for k, v in FAMILIES_MATRIX["gemma3"].config.items()} == before
    assert tiny_family_config("gemma3").num_hidden_layers == 2


def test_unknown_family_names_a_close_match():
    for call in (tiny_family_config, build_family, family_batch):
        with pytest.raises(UnknownFamilyError, match=r"Did you mean 'llama'") as info:
            call("lama")
        assert isinstance(info.value, ValueError)
    with pytest.raises(UnknownFamilyError, match="qwen3_moe"):
        tiny_family_config("qwen3moe")


# ----------------------------------------------------------------------------- building


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_family_trains(name):
    model = _model(name)
    model.zero_grad(set_to_none=True)
    ids = family_batch(name)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    assert out.logits.shape == (*ids.shape, 128)
    assert math.isfinite(out.loss.item()), f"{name}: loss {out.loss.item()}"
    out.loss.backward()
    no_grad = [k for k, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if name in NO_LM_GRADIENT:  # exactly the indexer's parameters, and only those
        assert no_grad and all(NO_LM_GRADIENT[name] in k for k in no_grad), (name, no_grad)
    else:
        assert not no_grad, f"{name}: parameters without a gradient: {no_grad}"
    bad = [
        k for k, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()
    ]
    assert not bad, f"{name}: non-finite gradients: {bad}"
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_same_seed_is_bit_identical_and_another_seed_differs(name):
    ref = _model(name).state_dict()
    torch.manual_seed(1234)
    torch.rand(7)  # the global RNG state before the build must not matter
    again = build_family(name).state_dict()
    assert ref.keys() == again.keys()
    for key, tensor in ref.items():
        assert tensor.dtype == again[key].dtype and torch.equal(tensor, again[key]), key
    other = dict(build_family(name, seed=1).named_parameters())
    same = [k for k, p in _floating(_model(name)).items() if torch.equal(p, other[k])]
    assert not same, f"{name}: seed 1 left these parameters equal to seed 0: {same}"


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_every_parameter_is_perturbed_and_buffers_are_left_alone(name):
    model = _model(name)
    constant = [
        k
        for k, p in _floating(model).items()
        if p.numel() > 1 and bool((p == p.flatten()[0]).all())
    ]
    assert not constant, f"{name}: constant (e.g. all-zero / all-one) parameters: {constant}"
    norms = [
        f"{mod_name}.{p_name}"
        for mod_name, mod in model.named_modules()
        if "norm" in type(mod).__name__.lower()
        for p_name, p in mod.named_parameters(recurse=False)
        if p.is_floating_point() and bool((p == 1).all())
    ]
    assert not norms, f"{name}: norm weights still all ones: {norms}"

    plain = build_family(name, perturb=0.0)
    unchanged = [k for k, p in _floating(plain).items() if torch.equal(p, _floating(model)[k])]
    assert not unchanged, f"{name}: perturbation missed {unchanged}"
    buffers = dict(model.named_buffers())
    for key, buf in plain.named_buffers():
        assert torch.equal(buf, buffers[key]), f"{name}: buffer {key} changed"


def test_unperturbed_build_really_has_trivial_weights():
    """The premise of the perturbation: HF initialises norms to ones and biases to zeros."""
    plain = dict(build_family("qwen2", perturb=0.0).named_parameters())
    assert bool((plain["model.norm.weight"] == 1).all())
    assert not plain["model.layers.0.self_attn.q_proj.bias"].any()
    gemma = dict(build_family("gemma", perturb=0.0).named_parameters())
    assert not gemma["model.norm.weight"].any()  # Gemma's norm is (1 + weight)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_meta_build_has_no_storage(name):
    model = build_family(name, device="meta")
    real = [k for k, t in (*model.named_parameters(), *model.named_buffers()) if not t.is_meta]
    want = [k for k, _ in model.named_parameters() if MATERIALIZED_ON_META.get(name, "\0") in k]
    assert real == want, f"{name}: materialized on meta: {real}"


#: Families whose code builds these parameters on the CPU whatever the default device:
#: DiffLlamaAttention draws its lambda vectors with ``torch.normal(mean, std, size=...)``,
#: which ignores ``with torch.device("meta")``.
MATERIALIZED_ON_META = {"diffllama": ".lambda_"}


def test_dtype_casts_parameters_after_the_fp32_perturbation():
    ref = _floating(_model("llama"))
    half = build_family("llama", dtype=torch.bfloat16)
    for key, p in _floating(half).items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, ref[key].to(torch.bfloat16)), key
    ids = family_batch("llama")
    assert math.isfinite(half(input_ids=ids, labels=ids, use_cache=False).loss.item())


def test_family_batch_is_deterministic_and_avoids_special_tokens():
    ids = family_batch("gpt2", batch=3, seq=64)
    assert ids.shape == (3, 64) and ids.dtype == torch.long
    assert int(ids.min()) >= 3 and int(ids.max()) < 128
    assert torch.equal(ids, family_batch("gpt2", batch=3, seq=64))
    assert not torch.equal(ids, family_batch("gpt2", batch=3, seq=64, seed=1))


def test_importing_the_module_does_not_import_transformers():
    code = (
        "import sys, hp_core.testing.families, hp_core.testing.family_matrix as f; "
        "assert 'transformers' not in sys.modules, 'transformers imported eagerly'; "
        "print(len(f.FAMILY_NAMES))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == len(FAMILY_NAMES)
