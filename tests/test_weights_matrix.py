"""Weights in and out across the differential matrix, not only the families named in issues.

Every family of ``hp_core.testing.family_matrix`` is saved with ``save_pretrained``, built on
the meta device, planned and applied at tp=2 (production and validate) and filled with
``hp_core.load_pretrained``: its logits equal the single-device model's, greedy
``generate()`` gives its tokens (production), and
``hp_core.full_state_dict`` gives back exactly what was saved, and so does its DCP
checkpoint loaded into one whole model in one process. The same runs at dp=2 x tp=2 under
FSDP2 (``fully_shard`` before the load) on every parameter layout the tp=2 pass met: the
first family that brings a layout no earlier one had (see :func:`fsdp2_families`). A family
the planner (or the
verifier) refuses is skipped here and counted: refusing is the planner's job (the training
matrix checks it); loading and exporting everything it takes is this test's. Validate mode
loads the same way on the same layouts, so it runs on that cover too (every family in
production mode).
"""

from __future__ import annotations

import pytest

from hp_core.testing import get_world
from hp_core.testing.families_hybrid import HYBRID_FAMILIES
from hp_core.testing.families_moe import MOE_FAMILIES
from hp_core.testing.family_matrix import FAMILY_NAMES
from tests import dist_tasks_weights_matrix as tasks

# one world task over 71 families takes minutes on 2 cores
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

MODES = ("production", "validate")
#: The MoE, MLA and hybrid rows added with the census are not loaded here yet: one of them
#: (dots3_note_text) has modules the loader finds no tensors for, and the rest are unchecked;
#: the loader's work on them is the next step (see the report of issue 23, session 3).
NOT_LOADED_YET = {f.name for f in (*MOE_FAMILIES, *HYBRID_FAMILIES)}
FAMILIES = [f for f in FAMILY_NAMES if f not in NOT_LOADED_YET]
#: Families loaded and exported at tp=2 (41 of 49 since fused projections and GPT-2's Conv1D
#: plan: phi3, gpt2, persimmon and dbrx joined; the other 8 are refused by the planner, issue
#: 14's ground); fewer is a regression of the planner or of the loader.
AT_LEAST = 41
#: Seconds the one task over the whole matrix may take.
MATRIX_TIMEOUT = 600.0
#: Families whose load fails today, with the error it fails with: each is a loader finding
#: (see the report of issue 23 item 6), asserted so that a fix shows up here.
KNOWN_LOAD_ERRORS = {
    # DiffLlamaAttention draws lambda_q1/k1/q2/k2 with torch.normal(..., size=...), which
    # ignores `with torch.device("meta")`: the meta build holds 8 real tensors, and
    # load_pretrained refuses a model that is not wholly on meta.
    "diffllama": "NotOnMetaError",
    # save_pretrained writes HrmText's layers in the original checkpoint format (fused
    # attn.gqkv_proj and mlp.gate_up_proj, transformers' weight conversion reversed): the
    # loader, reading by module names, finds 11 of the 35 tensors.
    "hrm_text": "CheckpointModelMismatchError",
    # Gemma3nForCausalLM._init_weights reads self.hidden_size, which the causal-LM class
    # lacks (transformers 5.25): its non-persistent per-layer scales cannot be recomputed.
    "gemma3n_text": "CheckpointKeysMissingError",
}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Production on every family; validate on a family of each layout production met."""
    root = str(tmp_path_factory.mktemp("weights"))
    world = get_world(2)
    # one task over the whole matrix: longer than a world's default 120 s
    prod = world.run(tasks.weights_matrix, root, FAMILIES, MODES[:1], timeout=MATRIX_TIMEOUT)
    cover = fsdp2_families(prod)
    val = world.run(
        tasks.weights_matrix, str(tmp_path_factory.mktemp("validate")), cover, MODES[1:]
    )
    for rank_prod, rank_val in zip(prod, val, strict=True):
        for family, by_mode in rank_val.items():
            rank_prod[family].update(by_mode)
    return prod


def fsdp2_families(matrix: list[dict]) -> list[str]:
    """The families whose FSDP2 load covers every parameter layout of the tp=2 pass.

    Loading under FSDP2 slices FSDP's piece of each local tp shard; what that depends on is
    the parameter's layout (its descriptor in ``layout_signature``: rank, placements, fused
    re-arrangement, even split, tied weights), not its family. Each family's key names and
    export are checked at tp=2 above. Walking the matrix in order, a family is taken when it
    brings a descriptor no family taken before had, so a new family with a new layout is
    taken automatically."""
    covered: set[str] = set()
    taken = []
    for family, by_mode in matrix[0].items():
        signature = set(by_mode.get("production", {}).get("signature", ()))
        if signature - covered:
            taken.append(family)
            covered |= signature
    return taken


def _check(results: list[dict], modes: tuple[str, ...], at_least: int = AT_LEAST) -> None:
    for rank_result in results:
        loaded = dict.fromkeys(modes, 0)
        for family, by_mode in rank_result.items():
            assert "crash" not in by_mode, (family, by_mode)
            for mode, r in by_mode.items():
                if "refused" in r:
                    continue
                if family in KNOWN_LOAD_ERRORS:
                    assert r.get("load_error", "").startswith(KNOWN_LOAD_ERRORS[family]), r
                    continue
                loaded[mode] += 1
                assert "load_error" not in r, (family, mode, r)
                assert r["logits"] <= 1e-5, (family, mode, r)
                if mode == "production":  # greedy tokens through the KV cache
                    assert r["generate"], (family, mode, r)
                assert not r["export_missing"] and not r["export_extra"], (family, mode, r)
                assert r["export_values"] == 0.0, (family, mode, r)
                if r["dcp"] is not None:  # rank 0 loaded the DCP checkpoint in one process
                    assert r["dcp"] == 0.0, (family, mode, r)
        assert loaded[modes[0]] >= at_least, loaded
        if len(modes) > 1:  # validate: every family of the cover the planner takes
            covered = [f for f, m in rank_result.items() if modes[1] in m]
            assert covered and loaded[modes[1]] >= len(covered) - sum(
                1
                for f in covered
                if "refused" in rank_result[f][modes[1]] or f in KNOWN_LOAD_ERRORS
            ), loaded


def test_every_family_the_planner_takes_loads_and_exports_exactly(matrix):
    _check(matrix, MODES)
    assert sum("validate" in m for m in matrix[0].values()) == len(fsdp2_families(matrix))


def test_under_fsdp2_on_dp_every_layout_loads_after_fully_shard(matrix, tmp_path):
    """dp=2 x tp=2, production, ``fully_shard`` on dp before ``load_pretrained``: each rank
    reads FSDP's piece; logits, the export and the DCP copy equal one device's, for a family
    of each parameter layout the tp=2 pass met."""
    families = fsdp2_families(matrix)
    every = set().union(
        *(set(r.get("production", {}).get("signature", ())) for r in matrix[0].values())
    )
    assert len(every) >= 12 and len(families) >= 6, (families, sorted(every))
    modes = (tasks.FSDP2,)
    results = get_world(4).run(tasks.weights_matrix, str(tmp_path), families, modes)
    _check(results, modes, at_least=len(families))


def test_the_fsdp2_selection_takes_a_family_with_a_new_layout():
    """Negative control of the selection: a family whose layout no earlier one has is taken,
    one whose every descriptor is covered is not."""
    matrix = [
        {
            "a": {"production": {"signature": ["1d replicated even=True", "2d Shard(dim=0)"]}},
            "b": {"production": {"signature": ["2d Shard(dim=0)"]}},
            "c": {"production": {"signature": ["2d Shard(dim=1) fused-dim0"]}},
            "d": {"production": {"refused": "PlanningError: ..."}},
        }
    ]
    assert fsdp2_families(matrix) == ["a", "c"]


def test_the_two_modes_plan_the_same_families(matrix):
    both = {f: m for f, m in matrix[0].items() if "validate" in m}
    assert both
    for family, by_mode in both.items():
        assert ("refused" in by_mode["production"]) == ("refused" in by_mode["validate"]), family


def test_a_wrong_value_in_the_checkpoint_fails_the_comparison(tmp_path):
    """Negative control: the same task on a checkpoint with one perturbed tensor reports it."""
    r = get_world(2).run(tasks.perturbed_family, str(tmp_path), "qwen2")[0]
    assert r["logits"] > 1e-3 and r["export_values"] > 1e-3 and r["dcp"] > 1e-3, r
