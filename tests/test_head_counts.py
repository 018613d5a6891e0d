"""Head counts of hand-written attention found by proof (issue 23 item 2).

hp finds which values a tp-sharded block's forward divides by a head count (a config
object's fields, attributes under names of its own) by searching the block's integer
attributes (and the region input's width, read as local) for the set whose local program
is the global one scaled. Each case plans its
attention tp-sharded with the attributes it found, and matches one device at tp=2 in
production and validate mode, sequence parallel on and off. The negative control switches
the search off on the ranks: production is then refused or trains wrong.
"""

from __future__ import annotations

import pytest
import torch

import hp_core
from hp_core.artifact import freeze, rebuild
from hp_core.planner import head_search
from hp_core.planner.local_width import INPUT_WIDTH, present_local
from hp_core.testing import check_equivalence, get_world
from tests import _head_count_models as models
from tests import forward_examples as fe

BLOCK = "layers.0.block"
#: case -> (a column-sharded weight, the row-sharded one, the attributes made local).
EXPECTED = {
    "config_split": (
        "q.weight",
        "proj.weight",
        {"config.n_head": (4, 2), "config.n_query_groups": (2, 1)},
    ),
    "config_fused": (
        "attn.weight",
        "proj.weight",
        {"config.n_head": (4, 2), "config.n_query_groups": (2, 1)},
    ),
    "names_split": (
        "wk.weight",
        "wo.weight",
        {"n_head": (4, 2), "n_local_heads": (2, 1), "dim": (32, 16)},
    ),
    "names_fused": (
        "wqkv.weight",
        "wo.weight",
        {"n_head": (4, 2), "n_local_heads": (2, 1), "dim": (32, 16)},
    ),
    "width_split": ("c_q.weight", "c_proj.weight", {"n_head": (4, 2), INPUT_WIDTH: (32, 16)}),
    "width_fused": (
        "c_attn.weight",
        "c_proj.weight",
        {"n_head": (4, 2), "n_embd": (32, 16), INPUT_WIDTH: (32, 16)},
    ),
}
CASES = list(EXPECTED)


def _meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return getattr(models, name)()


@pytest.mark.parametrize("name", CASES)
def test_the_plan_shards_attention_with_the_attributes_it_found(name: str) -> None:
    column, row, attrs = EXPECTED[name]
    block = hp_core.plan(_meta(name), "tp=2")[BLOCK]
    assert str(block.params[column]["tp"]) == "S(0)"
    assert str(block.params[row]["tp"]) == "S(1)"
    assert block._tp_local_attr_plan == attrs
    # Recorded as the user would declare them, so a saved or frozen plan re-derives them.
    assert isinstance(block.tp_divide_attrs, list)
    assert set(attrs) <= {*block.tp_divide_attrs, "n_head"}


def test_fused_layouts_are_read_off_the_forward() -> None:
    grouped = hp_core.plan(_meta("config_fused"), "tp=2")[BLOCK]._fused_layouts["attn.weight"]
    assert (grouped["kind"], grouped["parts"], grouped["units"]) == ("grouped", [64], [2])
    concat = hp_core.plan(_meta("names_fused"), "tp=2")[BLOCK]._fused_layouts["wqkv.weight"]
    assert (concat["kind"], concat["parts"], concat["units"]) == (
        "concatenated",
        [32, 16, 16],
        [4, 2, 2],
    )
    assert concat["names"] == ["q", "k", "v"]


def test_the_search_prefers_head_counts_to_per_head_widths() -> None:
    block = models.OtherNames(fused=False)
    names = head_search.candidates(block, 2, {2, 4, 8, 16, 32})
    assert names == ["n_head", "n_local_heads", "dim", "head_dim"]
    # A value the program never shows is no candidate; an odd one neither (tp=2 splits it).
    assert "head_dim" not in head_search.candidates(block, 2, {2, 4, 32})
    config = models.ConfigAttention(models.GptConfig(n_head=3, n_query_groups=1), fused=False)
    assert head_search.candidates(config, 2, {1, 3, 8, 24, 32}) == [
        "config.n_embd",
        "config.head_size",
    ]


def test_the_input_width_is_read_local_only_by_size_reads() -> None:
    x = torch.randn(2, 4, 32, requires_grad=True)
    (wide, mask), kw = present_local((x * 1, torch.ones(2, 4)), {"y": x * 1}, 32, 2)
    assert wide.size() == (2, 4, 16) and wide.shape == (2, 4, 16) and wide.shape[-1] == 16
    assert (wide.size(-1), wide.size(2), wide.size(0)) == (16, 16, 2)
    assert type(mask) is torch.Tensor and kw["y"].size(-1) == 16  # a mask is not the input
    out = torch.nn.functional.linear(wide, torch.ones(8, 32))  # every other op: the tensor
    assert type(out) is torch.Tensor and out.shape == (2, 4, 8)
    out.sum().backward()  # autograd stays attached
    assert x.grad is not None and torch.equal(x.grad, torch.full_like(x, 8.0))


def test_a_count_no_attribute_holds_is_still_refused() -> None:
    """Negative control of the search: ``ConstantHeads`` views by a module constant, so no
    set of its attributes (it has ``n_head``, unused) makes its program local: refused."""
    with pytest.raises(hp_core.LocalProgramError) as err:
        hp_core.plan(_meta("constant_heads"), "tp=2")
    assert str(err.value).startswith(f"{BLOCK}: ConstantHeads's forward")


@pytest.mark.parametrize("sp", [True, False])
@pytest.mark.parametrize("name", CASES)
def test_each_case_matches_one_device_in_both_modes(name: str, sp: bool) -> None:
    report = check_equivalence(
        models.CASES[name],
        fe.batch,
        "tp=2",
        plan_kwargs={"sequence_parallel": sp},
        loss_fn=fe.loss,
        world=get_world(2),
    )
    for key in ("production:logits", "production:grad", "validate:logits", "validate:grad"):
        assert report.worst[key] <= 1e-5, (key, report.worst)


@pytest.mark.parametrize("name", CASES)
def test_negative_control_without_the_search_production_is_refused_or_wrong(name: str) -> None:
    """The search switched off on the ranks: refused (the gate, or the verifier's meta run
    of production at apply) or, where nothing refuses, production's logits differ."""
    outcome = get_world(2).run(models.unsearched_equivalence, name, True)[0]
    refused = outcome.get("refused")
    worst = outcome.get("production:logits", 0.0)
    assert refused is not None or float(worst) > 1e-3, outcome  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["config_fused", "width_fused"])
def test_a_frozen_plan_re_derives_what_the_search_found(name: str) -> None:
    """An artifact keeps no tp-local attribute plan; it is re-derived from the model, and
    the search's result, recorded in ``tp_divide_attrs``, comes back with it."""
    model = _meta(name)
    found = hp_core.plan(model, "tp=2")
    back = rebuild(freeze(found), model=model)
    assert back[BLOCK]._tp_local_attr_plan == found[BLOCK]._tp_local_attr_plan
    assert back[BLOCK]._tp_local_attr_plan == EXPECTED[name][2]
