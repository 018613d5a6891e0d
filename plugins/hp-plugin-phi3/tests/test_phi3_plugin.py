"""hp-plugin-phi3: its rules classify a real Phi-3 model and agree with the core's own layout.

Discovery, provenance, isolation, the public surface and a tp=2 equivalence run are the
conformance suite's (``test_phi3_conformance.py``).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM

from hp_core.planner.templates import Role, RoleRule, classify_param
from hp_core.plugins import TEMPLATE_REGISTRY, reset_plugins

ARCH = "Phi3ForCausalLM"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    for var in ("HP_DISABLE_PLUGIN_AUTOLOAD", "HP_PLUGINS", "HP_PLUGINS_STRICT"):
        monkeypatch.delenv(var, raising=False)
    reset_plugins()
    yield
    reset_plugins()


def phi3_rules():
    return [item.value for item in TEMPLATE_REGISTRY.values() if item.provider == "phi3"]


def tiny_phi3() -> Phi3ForCausalLM:
    """A one-layer Phi-3 on the meta device (4 query heads, 2 kv heads)."""
    config = Phi3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    with torch.device("meta"):
        return Phi3ForCausalLM(config)


def test_rules_classify_a_real_phi3_model():
    model = tiny_phi3()
    rules = phi3_rules()
    expected = {
        "self_attn.qkv_proj.weight": Role.FUSED_QKV,
        "mlp.gate_up_proj.weight": Role.FUSED_GATE_UP,
        "self_attn.o_proj.weight": Role.ROWWISE,
        "mlp.down_proj.weight": Role.ROWWISE,
    }
    seen = {}
    for fqn, _ in model.named_parameters():
        matching = [r for r in rules if r.matches(fqn, (ARCH,))]
        suffix = next((s for s in expected if fqn.endswith(s)), None)
        if suffix is None:
            assert matching == [], fqn
            continue
        assert [r.role for r in matching] == [expected[suffix]], fqn
        assert (
            classify_param(
                fqn,
                [i.value for i in TEMPLATE_REGISTRY.values() if isinstance(i.value, RoleRule)],
                (ARCH,),
            )
            == expected[suffix]
        )
        seen[suffix] = fqn
    assert set(seen) == set(expected)
    # scoped: for another architecture the Phi-3 rules do not apply
    assert not any(r.matches(seen["mlp.down_proj.weight"], ("LlamaForCausalLM",)) for r in rules)


def test_the_hints_agree_with_the_core_and_the_parts_are_split_whole(monkeypatch):
    """With or without the plugin a Phi-3 plans the same: the fused q/k/v rows re-arranged
    so each tp rank holds whole heads of q, k and v (the core derives that from the config)."""
    import hp_core

    model = tiny_phi3()
    assert len(phi3_rules()) == 4  # loaded
    with_plugin = hp_core.plan(model, "tp=2")
    monkeypatch.setenv("HP_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_plugins()
    assert phi3_rules() == []
    without = hp_core.plan(model, "tp=2")
    assert with_plugin.fingerprint() == without.fingerprint()
    layout = with_plugin["model.layers.0.self_attn"]._fused_layouts["qkv_proj.weight"]
    assert (layout["kind"], layout["parts"], layout["units"]) == (
        "concatenated",
        [32, 16, 16],
        [4, 2, 2],
    )
