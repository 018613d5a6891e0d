"""Checks across the verifier's runs: the layouts boundaries exchange, and input gradients.

* What arrives at and leaves every boundary in production has the local shape its
  declared layouts give the unsharded model's tensors.
* Every boundary gives production the local shapes it gives validate mode.
* The gradient of each declared input is partial in DTensor's backward exactly where
  production's entry transition assumes it is (``hp_core.collectives.grad_is_partial``).
* The gradient of each undeclared tensor input is whole: production has no transition for
  it and hands its gradient back as the region's local backward makes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard

from hp_core.collectives import grad_is_partial
from hp_core.plans.fixes import fix_match
from hp_core.plans.model import ShardingPlan
from hp_core.plans.overrides import OverrideEntry
from hp_core.plans.proposal import Proposal, entries_text, propose, yaml_proposal
from hp_core.runtime.partial import is_data_axis
from hp_core.spec.module_spec import ModuleShardingSpec, layout_map
from hp_core.verifier.errors import (
    InputGradientError,
    LayoutMismatchError,
    ProductionDiffersError,
    VerificationError,
)
from hp_core.verifier.probes import BoundaryRecord

__all__ = [
    "arrival_check",
    "check_escaped_outputs",
    "check_input_gradients",
    "check_layouts",
    "check_modes_agree",
    "check_undeclared_inputs",
]


def check_modes_agree(
    val: Mapping[str, BoundaryRecord], prod: Mapping[str, BoundaryRecord]
) -> None:
    """Every boundary produces the same local shapes in production as in validate mode."""
    for fqn, rec in val.items():
        other = prod.get(fqn)
        if other is not None and rec.shapes != other.shapes:
            raise ProductionDiffersError(
                f"{fqn}: production mode produces local output shapes {other.shapes} where "
                f"validate mode produces {rec.shapes}: the module reads a size from its attributes "
                "or its inputs that the plan shards (declare it in tp_divide_attrs), or an "
                "output's declared layout is wrong."
            )


def _local_shape(
    shape: tuple[int, ...], layout: Mapping[str, Any], sizes: Mapping[str, int]
) -> tuple[int, ...] | None:
    """The local shape of a tensor of global ``shape`` in ``layout`` (None if a split is uneven)."""
    out = list(shape)
    for axis, p in layout.items():
        n = sizes.get(str(axis), 1)
        if isinstance(p, Shard) and n > 1:
            if p.dim >= len(out) or out[p.dim] % n:
                return None
            out[p.dim] //= n
    return tuple(out)


def arrival_check(
    plain: Mapping[str, BoundaryRecord], plan: ShardingPlan, sizes: Mapping[str, int]
) -> Callable[[str, int, dict[str, tuple[int, ...]]], None]:
    """A check, run as each boundary is entered, that its inputs arrive in their declared layout.

    Run during the validate pass, it names the first boundary whose contract disagrees with
    what its producer gives, before the wrong layout crashes code further on.
    """

    def check(fqn: str, call: int, local: dict[str, tuple[int, ...]]) -> None:
        ref = plain.get(fqn)
        if ref is None or ref.skipped or call >= len(ref.inputs):
            return
        spec = plan[fqn]
        for name, shape in ref.inputs[call].items():
            layout = layout_map(spec.in_src).get(name) or layout_map(spec.in_dst).get(name) or {}
            want, got = _local_shape(shape, layout, sizes), local.get(name)
            if got is not None and want != got:
                raise LayoutMismatchError(
                    f"{fqn}: its input {name!r} arrives with local shape {got} on each rank, but "
                    f"the plan has it arrive {_words(layout)}, which makes the unsharded model's "
                    f"{shape} into {want}. The model's own code between the block before it and "
                    "this one changes the activation (a reshape that flattens tokens, a slice, "
                    "a second path around the block) in a way the plan does not know.\nFix: plan "
                    "with "
                    "sequence_parallel=False, or override this module's input layout (in_src) "
                    "to what arrives."
                )

    return check


def check_layouts(
    plain: Mapping[str, BoundaryRecord],
    prod: Mapping[str, BoundaryRecord],
    plan: ShardingPlan,
    sizes: Mapping[str, int],
) -> None:
    """What arrives at and leaves each boundary has the local shape its declared layouts give
    the unsharded model's tensors: a boundary that declares a layout its producer does not
    give (an input said to be sharded that arrives whole, or the reverse) is refused."""
    arrives = arrival_check(plain, plan, sizes)
    for fqn, rec in prod.items():
        ref = plain.get(fqn)
        if ref is None or len(ref.inputs) != len(rec.inputs) or ref.skipped or rec.skipped:
            continue
        spec = plan[fqn]
        for call, loc_in in enumerate(rec.inputs):
            arrives(fqn, call, loc_in)
            outs = spec.output_names() or list(layout_map(spec.out_dst))
            if outs and ref.shapes[call] and rec.shapes[call]:
                layout = (
                    layout_map(spec.out_dst).get(outs[0])
                    or layout_map(spec.out_src).get(outs[0])
                    or {}
                )
                want, got = _local_shape(ref.shapes[call][0], layout, sizes), rec.shapes[call][0]
                if want != got:
                    raise LayoutMismatchError(
                        f"{fqn}: its output {outs[0]!r} leaves with local shape {got} on each "
                        f"rank, but the plan has it leave {_words(layout)}, which makes the "
                        f"unsharded model's {ref.shapes[call][0]} into {want}.\nFix: override "
                        "this module's output layout (out_dst) to what it produces, or keep it "
                        "whole on tp."
                    )


def _words(layout: Mapping[str, Any]) -> str:
    """``{tp: S(1)}`` in words: "split along dim 1 on tp" (what a message says)."""
    parts = []
    for axis, p in layout.items():
        if isinstance(p, Shard):
            parts.append(f"split along dim {p.dim} on {axis}")
        elif isinstance(p, Replicate):
            parts.append(f"whole on {axis}")
        else:
            parts.append(f"as {p} on {axis}")
    return ", ".join(parts) or "whole"


def check_input_gradients(
    records: Mapping[str, BoundaryRecord], plan: ShardingPlan, names: list[str]
) -> None:
    """Production's entry transitions assume an input gradient partial exactly where the
    boundary shards parameters; DTensor's backward must agree, or the two modes differ."""
    for fqn, rec in records.items():
        spec = plan[fqn]
        for name, seen in rec.input_grads.items():
            dst = layout_map(spec.in_dst).get(name) or layout_map(spec.in_src).get(name) or {}
            for named in seen:
                for axis, p in named:
                    if is_data_axis(axis) or not isinstance(dst.get(axis, Replicate()), Replicate):
                        continue
                    expected = grad_is_partial(spec, axis)
                    if isinstance(p, Partial) != expected:
                        raise InputGradientError(
                            f"{fqn}: the gradient of its input {name!r} is "
                            f"{'partial' if isinstance(p, Partial) else 'whole'} on {axis!r} in "
                            "DTensor's backward, but production's entry transition assumes it "
                            f"{'partial' if expected else 'whole'} (it "
                            f"{'sums' if expected else 'does not sum'} it over {axis}). The region "
                            "mixes sharded and replicated paths from this input; shard the "
                            "replicated ones, or keep the boundary whole on that axis."
                        )


def _declare_proposal(fqn: str, plan: ShardingPlan, names: list[str]) -> Proposal | None:
    """The fix that declares ``names`` in the layouts of the module's first declared input
    (what an alias of it needs; hp checks the fix before printing it). None where the
    module declares no input."""
    spec = plan[fqn]
    src, dst = layout_map(spec.in_src), layout_map(spec.in_dst)
    first = next(iter({**src, **dst}), None)
    if first is None:
        return None
    like_src, like_dst = src.get(first, dst.get(first)), dst.get(first, src.get(first))
    fix = ModuleShardingSpec(
        in_src={**src, **{n: dict(like_src or {}) for n in names}},
        in_dst={**dst, **{n: dict(like_dst or {}) for n in names}},
    )
    match = fix_match(fqn, plan.modules)
    what = f"declaring {', '.join(map(repr, names))} of {match} like its input {first!r}"
    return yaml_proposal(entries_text([OverrideEntry(match, fix)]), what)


def check_undeclared_inputs(
    records: Mapping[str, BoundaryRecord], plan: ShardingPlan, names: list[str]
) -> None:
    """A tensor input the contract does not declare gets no transition in production: its
    gradient goes back as the region's local backward makes it, so it must come out whole.
    One that comes out partial (CTRL gives its attention one tensor as v, k and q and the
    plan declares v only) would leave the rest of the model a per-rank gradient."""
    for fqn, rec in records.items():
        bad: dict[str, str] = {}
        for name, seen in rec.undeclared_grads.items():
            for named in seen:
                for axis, p in named:
                    if not is_data_axis(axis) and not isinstance(p, Replicate):
                        bad.setdefault(
                            name, f"{'partial' if isinstance(p, Partial) else p} on {axis!r}"
                        )
        if not bad:
            continue
        which = ", ".join(f"{n!r} ({why})" for n, why in bad.items())
        error = InputGradientError(
            f"{fqn}: the module is called with tensor input(s) {which} that its contract does "
            "not declare, and their gradient inside the region is not whole: production "
            "passes an undeclared input through untouched, so its gradient would go back "
            "unsummed and differ between ranks.\nFix: declare each of them (in_src and "
            "in_dst) in the layout it arrives in and is needed in."
        )
        fix = _declare_proposal(fqn, plan, [n for n in bad if "[" not in n])
        raise propose(error, fix) if fix is not None else error


def check_escaped_outputs(
    records: Mapping[str, BoundaryRecord], plan: ShardingPlan, sizes: Mapping[str, int]
) -> None:
    """Under sequence parallelism the model's code between boundaries runs on this rank's
    tokens: a gradient it sends back into an output the contract does not declare (GPT-NeoX-
    Japanese returns its attention's dense bias for the layer to add) covers those tokens
    only, and production hands it to the region unsummed. Without a tp axis of two or more
    ranks (an ep-only mesh) sequence parallelism shards nothing and every rank sees all tokens."""
    if not plan.sequence_parallel or sizes.get("tp", 1) < 2:
        return
    for fqn, rec in records.items():
        if rec.escaped:
            names = ", ".join(map(repr, sorted(rec.escaped)))
            raise VerificationError(
                f"{fqn}: the model's own code takes its output(s) {names}, which the contract "
                "does not declare, and sends a gradient back into them; with sequence "
                "parallelism that code runs on this rank's tokens only, so the gradient would "
                "reach the region unsummed and differ between ranks."
            )
