"""The census of every causal-LM family of the installed transformers (family_census)."""

from __future__ import annotations

from collections import Counter

import pytest
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hp_core.testing.family_census import KINDS, NOT_YET, Sources, census
from hp_core.testing.family_matrix import FAMILIES_MATRIX


def sources(**extra_causal: str) -> Sources:
    """What the census reads, from the installed transformers (plus fake keys)."""
    causal = {**modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, **extra_causal}
    return Sources(
        causal_lm=causal,
        config_classes={k: CONFIG_MAPPING[k] for k in causal if k in CONFIG_MAPPING},
        masked_lm=set(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
        seq2seq=set(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
        | set(modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES),
        multimodal=set(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
        | set(modeling_auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES),
    )


@pytest.fixture(scope="module")
def entries():
    return census(sources())


def test_every_key_of_the_installed_mapping_is_classified(entries):
    assert set(entries) == set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    unplaced = {k: e.reason for k, e in entries.items() if e.kind == "unclassified"}
    assert not unplaced, unplaced
    assert all(e.kind in KINDS and e.reason for e in entries.values())
    subkinds = {e.subkind for e in entries.values() if e.kind == "decoder-only"}
    assert subkinds <= {"dense", "moe", "mla", "recurrent/hybrid"}


def test_every_matrix_row_is_a_decoder_only_key_of_the_mapping(entries):
    for row in FAMILIES_MATRIX.values():
        assert entries[row.model_type].kind == "matrix", row.name


def test_the_census_reads_kinds_off_the_code(entries):
    """Spot checks, each from a different signal."""
    want = {
        "llama": "matrix",
        "exaone": "same-class",  # LlamaForCausalLM
        "gpt-sw3": "same-class",  # GPT2LMHeadModel
        "sarvam_mla": "matrix",  # a row builds it (also DeepseekV3ForCausalLM)
        "bert": "encoder",  # masked-LM mapping
        "bart": "encoder-decoder",  # is_encoder_decoder
        "whisper": "encoder-decoder",
        "trocr": "encoder-decoder",  # by hand
        "gemma3": "multimodal",  # ForConditionalGeneration
        "git": "multimodal",  # vision_config
        "mamba": "matrix",
        "lfm3": "matrix",
        "blt": "decoder-only",  # not a row yet (see NOT_YET)
    }
    assert {k: entries[k].kind for k in want} == want
    assert entries["mamba"].subkind == entries["lfm3"].subkind == "recurrent/hybrid"
    assert entries["jamba"].subkind == "recurrent/hybrid"
    assert entries["minicpm3"].subkind == "mla"
    assert entries["glm4_moe"].subkind == "moe"
    assert entries["gpt_neo"].subkind == "dense"
    assert entries["doge"].subkind == "dense"  # is_moe defaults to False
    assert entries["gemma4_text"].subkind == "dense"  # enable_moe_block defaults to False
    # matrix rows carry their sub-kind too
    assert entries["qwen3_next"].subkind == "recurrent/hybrid"
    assert entries["deepseek_v3"].subkind == "mla"
    assert entries["mixtral"].subkind == "moe"
    assert entries["llama"].subkind == "dense"


def test_every_decoder_only_key_is_a_matrix_row_or_listed_as_not_yet(entries):
    missing = sorted(k for k, e in entries.items() if e.kind == "decoder-only" and k not in NOT_YET)
    assert not missing, f"decoder-only families neither in the matrix nor in NOT_YET: {missing}"
    stale = {
        k: entries[k].kind if k in entries else "not in the mapping"
        for k in NOT_YET
        if k not in entries or entries[k].kind != "decoder-only"
    }
    assert not stale, f"NOT_YET lists keys that are not uncovered decoder-only families: {stale}"
    assert all(NOT_YET.values())
    # The table shrinks as rows are added: a change of its size is a visible edit here.
    assert len(NOT_YET) == 3


def test_counts_per_kind(entries):
    counts = Counter(e.kind for e in entries.values())
    assert sum(counts.values()) == len(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert counts["matrix"] == len({f.model_type for f in FAMILIES_MATRIX.values()})


def test_negative_control_a_fake_key_is_unclassified():
    entries = census(sources(not_a_real_family="NotARealFamilyForCausalLM"))
    assert entries["not_a_real_family"].kind == "unclassified"
    assert "no config class" in entries["not_a_real_family"].reason


def test_negative_control_a_new_decoder_only_key_fails_the_coverage_check():
    """A key that the code places as decoder-only but that no row or NOT_YET entry covers."""
    src = sources()
    fake = Sources(
        causal_lm={**src.causal_lm, "llama_clone": "LlamaCloneForCausalLM"},
        config_classes={**src.config_classes, "llama_clone": CONFIG_MAPPING["llama"]},
        masked_lm=src.masked_lm,
        seq2seq=src.seq2seq,
        multimodal=src.multimodal,
    )
    entry = census(fake)["llama_clone"]
    assert entry.kind == "decoder-only" and entry.subkind == "dense"
    assert "llama_clone" not in NOT_YET
