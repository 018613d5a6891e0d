"""The EP factories in one process (no expert group): each equals the block's own forward and
backward, asserts the block's interface, and checks its config keys."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hp_plugin_moe.errors import MoEConfigError, MoEInterfaceError, MoERuntimeError
from moe_toys import PerExpertMoE

import hp_plugin_moe as moe
from hp_core.context import ParallelContext
from hp_core.plugins import (
    UnknownRegistryItemError,
    register_router_adapter,
    registered_items,
    reset_plugins,
    suggest_compute_factory,
    unregister,
)
from hp_core.presets import build_model
from hp_core.testing.compare import allclose_excess, nan_safe_max

CTX = {"ctx": ParallelContext((), ())}


@pytest.fixture(autouse=True)
def _plugins(monkeypatch):
    for var in ("HP_DISABLE_PLUGIN_AUTOLOAD", "HP_PLUGINS", "HP_PLUGINS_STRICT"):
        monkeypatch.delenv(var, raising=False)
    reset_plugins()
    yield
    reset_plugins()


def _block(family: str, **config) -> torch.nn.Module:
    if family == "deepseekv3":
        from moe_tasks import deepseek_v3

        return deepseek_v3(num_hidden_layers=1, **config).model.layers[0].mlp
    if family in ("qwen3moe", "olmoe"):
        import transformers

        cls = {
            "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
            "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
        }[family]
        cfg = getattr(transformers, cls[0])(
            vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
            num_experts_per_tok=2,
        )  # fmt: skip
        torch.manual_seed(0)
        return getattr(transformers, cls[1])(cfg).model.layers[0].mlp
    return build_model(family, seed=0, num_hidden_layers=1, **config).model.layers[0].mlp


def _compare(block: torch.nn.Module, compute, *, seed: int = 0) -> tuple[float, float]:
    torch.manual_seed(seed)
    x = torch.randn(2, 8, 64, requires_grad=True)
    params = [x, *block.parameters()]
    ref = block(x)
    g = torch.randn_like(ref)
    gr = torch.autograd.grad(ref, params, g, allow_unused=True)
    out = compute(block, x)
    go = torch.autograd.grad(out, params, g, allow_unused=True)
    # NaN-safe: a NaN/inf or a shape mismatch is an infinite difference (max(0, nan) is 0).
    grads = nan_safe_max(_abs_diff(a, b) for a, b in zip(gr, go, strict=True))
    return allclose_excess(out.detach(), ref.detach(), rtol=0.0), grads


def _abs_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """max |a - b|, NaN-safe; a missing gradient counts as zeros."""
    if a is None and b is None:
        return 0.0
    a = torch.zeros_like(b) if a is None else a
    b = torch.zeros_like(a) if b is None else b
    return allclose_excess(a, b, rtol=0.0)


@pytest.mark.parametrize(
    "family,factory,config",
    [
        ("qwen2moe", moe.qwen2moe, {}),
        ("mixtral", moe.mixtral, {}),
        ("deepseekv3", moe.deepseekv3, {}),
        ("deepseekv3", moe.deepseekv3, {"router": "sigmoid_group_topk"}),
        ("qwen3moe", moe.routed_only, {}),
        ("olmoe", moe.routed_only, {}),
    ],
    ids=[
        "qwen2moe",
        "mixtral",
        "deepseekv3",
        "deepseekv3-sigmoid-group-router",
        "qwen3moe-routed-only",
        "olmoe-routed-only",
    ],
)
def test_factory_equals_the_hf_block(family, factory, config):
    block = _block(family)
    compute = factory(module=block, **CTX, **config)
    out, grads = _compare(block, compute)
    assert out <= 1e-6 and grads <= 1e-5
    assert (
        str(inspect.signature(compute)) == "(module, " + str(inspect.signature(block.forward))[1:]
    )
    assert list(inspect.signature(compute).parameters) == ["module", "hidden_states"]


@pytest.mark.parametrize("bias", [False, True])
def test_per_expert_modulelist_without_stacking(bias):
    block = PerExpertMoE(bias=bias)
    compute = moe.routed_only(module=block, **CTX)
    assert compute.experts.kind == "per_expert" and compute.router_name == "softmax_topk"
    assert compute.options.normalize and compute.options.top_k == 2  # from the block's attributes
    out, grads = _compare(block, compute)
    assert out <= 1e-6 and grads <= 1e-6
    # norm_topk_prob overrides the block's attribute, and really changes the result
    other = moe.routed_only(module=block, **CTX, norm_topk_prob=False)
    assert 1e-3 < _compare(block, other)[0] < math.inf


def test_capacity_factor_drops_the_pairs_beyond_each_experts_capacity():
    block = _block("mixtral")
    x = torch.randn(16, 64)
    _, weights, experts = block.gate(x)
    compute = moe.mixtral(module=block, **CTX, capacity_factor=0.5)
    cap = math.ceil(0.5 * 16 * 2 / 4)
    keep = torch.zeros_like(weights, dtype=torch.bool)
    for e in range(4):
        rows, slots = (experts == e).nonzero(as_tuple=True)  # token order, as dispatched
        keep[rows[:cap], slots[:cap]] = True
    expected = block.experts(x, experts, weights * keep)
    out = compute(block, x)
    assert compute.dispatcher.last_dropped == int((~keep).sum()) > 0
    assert torch.allclose(out, expected, atol=1e-6)
    generous = moe.mixtral(module=block, **CTX, capacity_factor=8.0)
    assert (
        torch.allclose(generous(block, x[None]), block(x[None]), atol=1e-6)
        and generous.dispatcher.last_dropped == 0
    )


def test_mixtral_jitter_noise_applies_in_training_only():
    block = _block("mixtral")
    compute = moe.mixtral(module=block, **CTX, jitter_noise=0.5)
    x = torch.randn(1, 8, 64)
    block.eval()
    assert torch.equal(compute(block, x), block(x))
    block.train()
    torch.manual_seed(1)
    a = compute(block, x)
    torch.manual_seed(2)
    assert not torch.allclose(a, compute(block, x))
    block.jitter_noise = 0.25
    assert moe.mixtral(module=block, **CTX).jitter_noise == 0.25  # default: the block's own setting


@pytest.mark.parametrize(
    "family,factory,problem",
    [
        (
            "qwen2moe",
            moe.mixtral,
            "it has shared experts (shared_expert, shared_expert_gate), which mixtral",
        ),
        (
            "qwen2moe",
            moe.routed_only,
            "which routed_only (routed experts only) would silently drop",
        ),
        (
            "deepseekv3",
            moe.qwen2moe,
            "it lacks 'shared_expert', 'shared_expert_gate', which the qwen2moe archetype",
        ),
        ("mixtral", moe.deepseekv3, "it lacks 'shared_experts', which the deepseekv3 archetype"),
    ],
)
def test_wrong_archetype_lists_the_blocks_children_and_shapes(family, factory, problem):
    block = _block(family)
    with pytest.raises(MoEInterfaceError) as exc:
        factory(module=block, **CTX)
    msg = str(exc.value)
    assert problem in msg
    assert (
        f"{type(block).__name__} has\n  children: " in msg
        and "  parameters: " in msg
        and "gate.weight (" in msg
    )
    assert "\nFix: use " in msg


def test_interface_errors_name_what_is_missing():
    class NoRouter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

        def forward(self, hidden_states):
            return hidden_states

    with pytest.raises(
        MoEInterfaceError, match="NoRouter: it has no router child named 'gate' or 'router'"
    ):
        moe.routed_only(module=NoRouter(), **CTX)
    block = NoRouter()
    block.gate = torch.nn.Linear(4, 1)
    with pytest.raises(
        MoEInterfaceError,
        match=r"its experts are a ModuleList of Linear, which lacks SwiGLU Linears "
        r"named gate_proj/up_proj/down_proj or w1/w3/w2",
    ) as exc:
        moe.routed_only(module=block, **CTX)
    assert "parameters: experts.0.weight (4, 4), experts.0.bias (4,), gate.weight (1, 4)" in str(
        exc.value
    )
    block.experts = torch.nn.ModuleList()
    with pytest.raises(MoEInterfaceError, match="its 'experts' ModuleList is empty"):
        moe.routed_only(module=block, **CTX)
    del block.experts
    with pytest.raises(MoEInterfaceError, match="it has no 'experts' child"):
        moe.routed_only(module=block, **CTX)
    block.experts = torch.nn.Linear(4, 4)
    with pytest.raises(MoEInterfaceError, match=r"neither batched .* nor a ModuleList"):
        moe.routed_only(module=block, **CTX)
    with pytest.raises(MoEConfigError, match="needs the MoE block as 'module'"):
        moe.routed_only(module=None, **CTX)


def test_batched_experts_with_extra_parameters_are_refused():
    block = _block("mixtral")
    block.experts.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(4, 64))
    with pytest.raises(
        MoEInterfaceError, match=r"its batched experts also hold \['gate_up_proj_bias'\]"
    ):
        moe.mixtral(module=block, **CTX)


def test_forward_with_other_required_inputs_is_refused():
    class TwoInputs(PerExpertMoE):
        def forward(self, hidden_states, padding_mask):  # type: ignore[override]
            return super().forward(hidden_states)

    with pytest.raises(
        MoEInterfaceError,
        match=r"takes required input\(s\) \['padding_mask'\] besides 'hidden_states'",
    ):
        moe.routed_only(module=TwoInputs(), **CTX)

    class Optional(PerExpertMoE):
        def forward(self, hidden_states, scale=None):  # type: ignore[override]
            return super().forward(hidden_states)

    block = Optional()
    compute = moe.routed_only(module=block, **CTX)
    x = torch.randn(3, 64)
    assert torch.allclose(compute(block, x, scale=None), block(x), atol=1e-6)
    with pytest.raises(
        MoERuntimeError,
        match="was called with scale=2; the MoE compute routes 'hidden_states' only",
    ):
        compute(block, x, scale=2)


@pytest.mark.parametrize(
    "config,error",
    [
        ({"capacity_factor": 0}, "capacity_factor must be a positive number"),
        ({"capacity_factor": True}, "capacity_factor must be a positive number"),
        ({"jitter_noise": 1.5}, r"jitter_noise must be a number in \[0, 1\)"),
        ({"router": 3}, "router must be a router adapter name"),
    ],
)
def test_config_values_are_checked(config, error):
    with pytest.raises(MoEConfigError, match=error):
        moe.mixtral(module=_block("mixtral"), **CTX, **config)


def test_router_options_that_would_do_nothing_are_refused():
    with pytest.raises(
        MoEConfigError, match=r"config key\(s\) \['top_k'\] do nothing with router 'hf_topk'"
    ):
        moe.routed_only(module=_block("mixtral"), **CTX, top_k=2)
    block = PerExpertMoE()
    del block.top_k
    with pytest.raises(
        MoEConfigError,
        match=r"(?s)has no integer top_k attribute .*\nFix: set the config key top_k: N",
    ):
        moe.routed_only(module=block, **CTX)
    assert moe.routed_only(module=block, **CTX, top_k=1).options.top_k == 1


def test_router_adapters_are_a_registry():
    with pytest.raises(
        UnknownRegistryItemError,
        match=r"unknown router adapter 'softmax_top'.*Did you mean 'softmax_topk'",
    ):
        moe.routed_only(module=PerExpertMoE(), **CTX, router="softmax_top")
    calls = []

    def first_two(module, hidden, options):
        calls.append(hidden.shape)
        t = hidden.shape[0]
        return torch.full((t, 2), 0.5), torch.tensor([[0, 1]]).expand(t, 2)

    register_router_adapter("first_two", first_two)
    try:
        block = PerExpertMoE()
        compute = moe.routed_only(module=block, **CTX, router="first_two")
        x = torch.randn(5, 64)
        expected = 0.5 * (block.experts[0](x) + block.experts[1](x))
        assert torch.allclose(compute(block, x), expected, atol=1e-6) and calls == [(5, 64)]
    finally:
        unregister("router_adapter", "first_two")


def test_hf_topk_on_a_router_that_returns_logits_says_which_adapter_to_use():
    block = PerExpertMoE()
    with pytest.raises(
        MoEInterfaceError, match="returned Tensor, not \\(logits, weights, experts\\)"
    ) as exc:
        moe.routed_only(module=block, **CTX, router="hf_topk")(block, torch.randn(2, 64))
    assert "use router: softmax_topk" in str(exc.value)


def test_sigmoid_group_router_needs_its_attributes():
    block = PerExpertMoE()
    with pytest.raises(MoEInterfaceError, match="lacks a router weight, e_score_correction_bias"):
        moe.routed_only(module=block, **CTX, router="sigmoid_group_topk")(block, torch.randn(2, 64))


def test_sigmoid_group_router_on_a_plain_gate_is_picked_automatically():
    """A hand-written DeepSeek-V3-style block: a Linear gate plus the correction bias."""
    hf = _block("deepseekv3")
    block = PerExpertMoE(experts=8)
    block.e_score_correction_bias = hf.gate.e_score_correction_bias.clone()
    block.n_group, block.topk_group, block.routed_scaling_factor = (
        2,
        1,
        hf.gate.routed_scaling_factor,
    )
    with torch.no_grad():
        block.gate.weight.copy_(hf.gate.weight)
    compute = moe.routed_only(module=block, **CTX)
    assert compute.router_name == "sigmoid_group_topk"
    x = torch.randn(6, 64)
    w, e = compute.router(block, x, compute.options)
    _, hw, he = hf.gate(x)
    assert torch.equal(e, he) and torch.allclose(w, hw)


def test_experts_resharded_after_binding_are_detected():
    block = _block("qwen2moe")
    compute = moe.qwen2moe(module=block, **CTX)
    block.experts.gate_up_proj = torch.nn.Parameter(block.experts.gate_up_proj[:2].detach())
    block.experts.down_proj = torch.nn.Parameter(block.experts.down_proj[:2].detach())
    with pytest.raises(
        MoERuntimeError, match="holds 2 experts on this rank, but the compute was bound for 4"
    ):
        compute(block, torch.randn(3, 64))
    per_expert = PerExpertMoE()
    compute = moe.routed_only(module=per_expert, **CTX)
    per_expert.experts = torch.nn.Module()
    with pytest.raises(
        MoERuntimeError,
        match="neither the per-expert ModuleList the factory was bound to nor its stacked form",
    ):
        compute(per_expert, torch.randn(3, 64))


def test_plugin_registers_factories_routers_and_the_suggestion_table():
    items = {(i.kind.value, i.name): i for i in registered_items() if i.provider == "moe"}
    assert set(items) == {
        ("compute_factory", "qwen2moe"),
        ("compute_factory", "mixtral"),
        ("compute_factory", "routed_only"),
        ("compute_factory", "deepseekv3"),
        ("router_adapter", "hf_topk"),
        ("router_adapter", "softmax_topk"),
        ("router_adapter", "sigmoid_group_topk"),
    }
    assert items[("compute_factory", "qwen2moe")].value is moe.qwen2moe
    assert {
        arch: suggest_compute_factory(arch)
        for arch in (
            "Qwen2MoeForCausalLM",
            "MixtralForCausalLM",
            "DeepseekV3ForCausalLM",
            "Qwen3MoeForCausalLM",
            "LlamaForCausalLM",
        )
    } == {
        "Qwen2MoeForCausalLM": "qwen2moe",
        "MixtralForCausalLM": "mixtral",
        "DeepseekV3ForCausalLM": "deepseekv3",
        "Qwen3MoeForCausalLM": "routed_only",
        "LlamaForCausalLM": None,
    }


def test_config_keys_of_each_factory():
    keys = {
        name: getattr(moe, name)._injection_meta.config_keys
        for name in ("qwen2moe", "mixtral", "routed_only", "deepseekv3")
    }
    assert keys == {
        "qwen2moe": ("capacity_factor", "router"),
        "mixtral": ("capacity_factor", "router", "jitter_noise"),
        "routed_only": ("capacity_factor", "router", "top_k", "norm_topk_prob"),
        "deepseekv3": ("capacity_factor", "router"),
    }


def test_describe_module_truncates_long_parameter_lists():
    text = moe.describe_module(PerExpertMoE(experts=8))
    assert text.startswith(
        "  children: gate (Linear), experts (ModuleList)\n  parameters: gate.weight (8, 64), "
        "experts.0.gate_proj.weight (32, 64)"
    )
    assert text.endswith(", ... and 13 more")
    assert (
        repr(moe.routed_only(module=PerExpertMoE(), **CTX))
        == "ExpertParallelMoE(routed_only, experts=4 per_expert, ep=1, router=softmax_topk)"
    )


def test_expert_count_must_divide_over_the_expert_group():
    class ExpertMesh:
        mesh_dim_names = ("edp", "ep")

        def __getitem__(self, name: str) -> ExpertMesh:
            return self

        def size(self) -> int:
            return 3

    with pytest.raises(MoEConfigError, match="mixtral: 4 experts cannot be split over ep=3 ranks"):
        moe.mixtral(module=_block("mixtral"), ctx=CTX["ctx"].with_ep_mesh(ExpertMesh()))


def test_experts_without_an_activation_use_silu():
    import torch.nn.functional as F

    block = PerExpertMoE()
    for expert in block.experts:
        del expert.act_fn
        expert.act_fn = F.silu  # a plain function (not a module) is used as it is
    assert moe.routed_only(module=block, **CTX).experts.act is F.silu
    for expert in block.experts:
        del expert.act_fn
    compute = moe.routed_only(module=block, **CTX)
    assert compute.experts.act is F.silu


def test_forward_without_a_positional_input_is_refused():
    class KeywordOnly(PerExpertMoE):
        def forward(self, *, hidden_states):  # type: ignore[override]
            return super().forward(hidden_states)

    with pytest.raises(
        MoEInterfaceError,
        match=r"does not take the hidden states as its first positional parameter",
    ):
        moe.routed_only(module=KeywordOnly(), **CTX)


def test_builtin_routers_work_when_the_plugin_is_not_loaded(monkeypatch):
    monkeypatch.setenv("HP_PLUGINS", "")
    block = PerExpertMoE()
    compute = moe.routed_only(module=block, **CTX, router="softmax_topk")
    x = torch.randn(4, 64)
    assert torch.allclose(compute(block, x), block(x), atol=1e-6)
