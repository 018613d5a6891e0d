"""The derived expert mesh (edp, ep) and the checks on expert-parallel boundaries, without
process groups: which ranks exchange tokens, which replicas hp sums, what preflight refuses."""

from __future__ import annotations

import dataclasses

import pytest

from hp_core import plan
from hp_core.mesh import MeshSpec
from hp_core.presets import build_model
from hp_core.runtime.errors import PreflightError
from hp_core.runtime.experts import (
    ExpertParallelError,
    check_expert_boundary,
    every_layer,
    expert_layout,
    expert_placements,
)
from tests._planner_helpers import builtin_only  # noqa: F401  (fixture)
from tests._toy_models import list_moe_lm

pytestmark = pytest.mark.usefixtures("builtin_only")
MOE = "model.layers.0.mlp"


def _layout(mesh: str, ep: int, *, experts: int = 4, sp: bool = True, overrides=None):
    model = build_model("qwen2moe", device="meta", num_experts=experts, num_key_value_heads=4)
    p = plan(model, mesh, ep_size=ep, sequence_parallel=sp, overrides=overrides)
    spec = MeshSpec.parse(mesh)
    return expert_layout(MOE, p[MOE], p, spec, tuple(range(spec.world_size)))


def test_tp2_ep2_the_tp_ranks_are_the_expert_group():
    layout = _layout("tp=2", 2)
    assert (layout.groups, layout.edp, layout.spanned) == (((0, 1),), 1, ("tp",))
    assert layout.replica_groups == ((0,), (1,)) and not layout.sums_replicas


def test_dp2_tp2_ep4_one_group_over_every_rank():
    layout = _layout("dp=2,tp=2", 4)
    assert layout.groups == ((0, 1, 2, 3),) and layout.spanned == ("tp", "dp")
    assert not layout.sums_replicas


def test_dp2_tp2_ep2_replicas_along_dp_are_left_to_data_parallelism():
    layout = _layout("dp=2,tp=2", 2)
    assert layout.groups == ((0, 1), (2, 3)) and layout.edp == 2
    assert layout.replica_groups == ((0,), (1,), (2,), (3,))


def test_tp4_ep2_replicas_inside_the_region_are_summed():
    layout = _layout("tp=4", 2)
    assert layout.groups == ((0, 1), (2, 3)) and layout.spanned == ("tp",)
    assert layout.replica_groups == ((0, 2), (1, 3)) and layout.sums_replicas


def test_cp_and_tp_both_shard_tokens():
    layout = _layout("cp=2,tp=2", 2)
    assert layout.groups == ((0, 1), (2, 3)) and layout.replica_groups == ((0, 2), (1, 3))
    assert _layout("cp=2,tp=2", 4).groups == ((0, 1, 2, 3),)


def test_ep_size_must_divide_the_region():
    with pytest.raises(ExpertParallelError) as exc:
        _layout("tp=2", 4, experts=8)
    assert str(exc.value).startswith(
        f"{MOE}: ep_size=4 does not divide the dense region's 2 ranks (mesh tp=2)"
    )
    assert isinstance(exc.value, PreflightError)


def test_ep_must_not_cut_across_an_axis():
    with pytest.raises(
        ExpertParallelError,
        match=r"ep_size=3 does not fit the mesh dp=3,tp=2: an expert group is ep consecutive ranks",
    ):
        _layout("dp=3,tp=2", 3, experts=6)
    assert _layout("dp=3,tp=2", 6, experts=6).groups == ((0, 1, 2, 3, 4, 5),)


def test_an_expert_group_over_replicated_tokens_is_refused_with_the_fix():
    with pytest.raises(ExpertParallelError) as exc:
        _layout("tp=2", 2, sp=False)
    msg = str(exc.value)
    assert msg.startswith(
        f"{MOE}: the expert group of ep=2 spans the 'tp' axis, along which this block's "
        "tokens are replicated"
    )
    assert (
        "  - match: 'model.layers.*.mlp'\n    when: ep\n    in_dst: {hidden_states: {tp: "
        "shard(1)}}\n    out_src: {output: {tp: shard(1)}}" in msg
    )
    fixed = _layout(
        "tp=2",
        2,
        sp=False,
        overrides=[
            {
                "match": "model.layers.*.mlp",
                "in_dst": {"hidden_states": {"tp": "shard(1)"}},
                "out_src": {"output": {"tp": "shard(1)"}},
            }
        ],
    )
    assert fixed.groups == ((0, 1),)


def test_expert_parameters_live_on_ep_only():
    model = build_model("qwen2moe", device="meta")
    p = plan(model, "tp=2", ep_size=2)
    spec = dataclasses.replace(p[MOE])
    spec._ep_size = 2
    spec.params = {
        **spec.params,
        "experts.down_proj": {
            "ep": p[MOE].params["experts.down_proj"]["ep"],
            "tp": p[MOE].params["gate.weight"]["tp"],
        },
    }
    check_expert_boundary(MOE, spec, model.get_submodule(MOE))  # replicate on tp is fine
    from torch.distributed.tensor import Shard

    spec.params["experts.down_proj"] = {"ep": Shard(0), "tp": Shard(1)}
    with pytest.raises(
        ExpertParallelError,
        match=r"experts.down_proj: an expert parameter lives on the expert mesh \(edp, ep\) and "
        r"can only be placed on ep",
    ):
        check_expert_boundary(MOE, spec, model.get_submodule(MOE))
    assert expert_placements({"ep": Shard(0)})[1] == Shard(0)


def _list_spec():
    model = list_moe_lm()
    fqn = "model.layers.0.block_sparse_moe"
    p = plan(model, "tp=2", ep_size=2)
    spec = dataclasses.replace(p[fqn])
    spec._ep_size, spec._ep_stack = 2, {k: list(v) for k, v in p[fqn]._ep_stack.items()}
    return fqn, spec, model.get_submodule(fqn)


def test_per_expert_modules_must_be_stacked_whole():
    fqn, spec, module = _list_spec()
    check_expert_boundary(fqn, spec, module)
    spec._ep_stack["experts.w1.weight"].pop()
    with pytest.raises(
        ExpertParallelError,
        match=r"the per-expert modules under 'experts' hold \['experts.3.w1.weight'\] besides the "
        r"stacked projections",
    ):
        check_expert_boundary(fqn, spec, module)


def test_stack_sources_must_exist_agree_and_be_per_expert_paths():
    fqn, spec, module = _list_spec()
    spec._ep_stack["experts.w1.weight"][3] = "experts.7.w1.weight"
    with pytest.raises(
        ExpertParallelError,
        match=r"per-expert parameter\(s\) \['experts.7.w1.weight'\] of _ep_stack do not exist",
    ):
        check_expert_boundary(fqn, spec, module)
    fqn, spec, module = _list_spec()
    import torch

    module.experts[1].w2.weight = torch.nn.Parameter(torch.zeros(64, 16))
    with pytest.raises(
        ExpertParallelError,
        match=r"the experts' experts.w2.weight have different shapes \[\(64, 16\), \(64, 32\)\]",
    ):
        check_expert_boundary(fqn, spec, module)
    spec._ep_stack = {"experts.w1.weight": ["gate.weight"]}
    with pytest.raises(
        ExpertParallelError, match=r"'gate.weight' is not a per-expert path of 'experts.w1.weight'"
    ):
        check_expert_boundary(fqn, spec, module)
    spec._ep_stack = {"moe.w1.weight": ["moe.0.w1.weight"]}
    with pytest.raises(
        ExpertParallelError, match=r"_ep_stack names 'moe', which ListMoE does not have"
    ):
        check_expert_boundary(fqn, spec, module)


def test_every_layer_glob():
    assert every_layer("model.layers.0.mlp") == "model.layers.*.mlp"
    assert every_layer("blocks.12") == "blocks.*" and every_layer("a.b3.c") == "a.b3.c"


class _FakeMesh:
    """A mesh of names, sizes and rank ids only (what the pure part of preflight reads)."""

    def __init__(self, names: tuple[str, ...], sizes: tuple[int, ...]) -> None:
        import torch

        self.mesh_dim_names, self.shape = names, sizes
        self.mesh = torch.arange(int(torch.tensor(sizes).prod())).reshape(sizes)

    def get_group(self, *_a):  # pragma: no cover - never called by the layout checks
        return None


def test_the_region_must_span_every_rank():
    from hp_core.runtime.preflight import _expert_layouts

    model = build_model("qwen2moe", device="meta")
    p = plan(model, "tp=2", ep_size=2)
    with pytest.raises(
        ExpertParallelError,
        match=r"model.layers.0.mlp: expert parallelism derives its expert mesh from the dense "
        r"region, which must span every rank of the job; the mesh has 2 of 1 ranks",
    ):
        _expert_layouts(model, p, _FakeMesh(("tp",), (2,)))


def test_blocks_with_the_same_ep_need_the_same_token_layout(monkeypatch):
    import torch.distributed as dist

    from hp_core.runtime.preflight import _expert_layouts

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 4)
    model = build_model("qwen2moe", device="meta", num_key_value_heads=4)
    same = plan(model, "cp=2,tp=2", ep_size=2)
    layouts = _expert_layouts(model, same, _FakeMesh(("cp", "tp"), (2, 2)))
    assert list(layouts) == [2] and layouts[2].replica_groups == ((0, 2), (1, 3))
    # layer 1's tokens are whole on cp: its replicas along cp hold the same tokens
    other = plan(
        model,
        "cp=2,tp=2",
        ep_size=2,
        overrides=[
            {"match": "model.layers.1.mlp", "in_dst": {"hidden_states": {"tp": "shard(1)"}}}
        ],
    )
    with pytest.raises(
        ExpertParallelError,
        match=r"model.layers.1.mlp: its tokens are laid out differently from those of "
        r"model.layers.0.mlp \(another block with ep=2\)",
    ):
        _expert_layouts(model, other, _FakeMesh(("cp", "tp"), (2, 2)))


def test_stacked_experts_module():
    from hp_core.runtime.experts import StackedExperts

    assert repr(StackedExperts(8)) == "StackedExperts(num_experts=8)"


def test_fixes_match_only_the_expert_parallel_blocks():
    """With dense MLP layers between the MoE ones, a glob would hit them too: list the blocks."""
    from hp_core.runtime.errors import PreflightError
    from hp_core.runtime.experts import expert_matches, override_entries
    from hp_core.runtime.preflight import preflight

    model = build_model("qwen2moe", device="meta", num_hidden_layers=3, mlp_only_layers=[1])
    p = plan(model, "dp=2", ep_size=2)
    assert expert_matches(p, MOE) == ["model.layers.0.mlp", "model.layers.2.mlp"]
    assert expert_matches(plan(build_model("qwen2moe", device="meta"), "dp=2", ep_size=2), MOE) == [
        "model.layers.*.mlp"
    ]
    with pytest.raises(PreflightError) as exc:
        preflight(model, p, _FakeMesh(("dp",), (2,)), "production")
    # Only the built-in plugin is loaded here, so no factory is registered for the model.
    expected = override_entries(
        ["model.layers.0.mlp", "model.layers.2.mlp"],
        "    local_compute_fn: FACTORY\n    region_dispatch: false\n",
    )
    assert (
        f"Add:\n{expected}(no installed plugin registers a factory for Qwen2MoeForCausalLM: "
        "install hp-plugin-moe" in str(exc.value)
    )


def test_an_expert_parallel_compute_must_not_dispatch():
    model = build_model("qwen2moe", device="meta")
    p = plan(
        model,
        "tp=2",
        ep_size=2,
        overrides=[
            {"match": "model.layers.*.mlp", "local_compute_fn": "qwen2moe", "region_dispatch": True}
        ],
        check_items=False,  # built-in templates only: hp-plugin-moe is not loaded here
    )
    with pytest.raises(
        ExpertParallelError,
        match=r"model.layers.0.mlp: an expert-parallel compute communicates .* declare "
        r"region_dispatch: false",
    ):
        check_expert_boundary(MOE, p[MOE], model.get_submodule(MOE))
