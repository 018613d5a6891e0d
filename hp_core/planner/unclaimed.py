"""Parameters no boundary template claimed: declared by an override, or refused with a fix.

A parameter the templates did not recognise (a stray scale, a learned position table on the
model itself) has no layout hp could derive. It is fine when an override declares it; else
the plan is refused, proposing to keep it whole — fixes hp checks before printing one
(:mod:`hp_core.verifier.advice`).

Under sequence parallelism the first fix proposed makes the module that holds such
parameters a boundary of its own, on the sequence shards the blocks hand each other: its
parameters whole, its forward run on DTensors in validate mode. DTensor then proves that
forward token-wise (code that mixes along the sequence, a causal conv, would need a
redistribution, which the verifier refuses) and derives the reduction of the parameters'
partial gradients. A parameter on the decoder layer itself (whose children are boundaries)
joins the layer's region instead: under sequence parallelism that is a region on local
tensors already running on the shards, whose contract sums the gradient. The second fix
keeps the parameters whole outside every boundary; code hp does not lay out may meet
sequence shards there, so that fix is only tried with sequence parallelism off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Placement, Replicate

from hp_core.planner.structure import ModelStructure, UncoveredParameterError, positional_names
from hp_core.planner.trace import ModuleCall, TraceFailedError
from hp_core.planner.trace import trace as run_trace
from hp_core.plans.example import ExampleCall, default_call
from hp_core.plans.overrides import OverrideEntry
from hp_core.plans.proposal import Proposal, entries_text, propose, yaml_proposal
from hp_core.spec.module_spec import ModuleShardingSpec, layout_map
from hp_core.spec.placements import NamedPlacement

__all__ = ["check_unclaimed"]


def check_unclaimed(
    structure: ModelStructure,
    modules: Mapping[str, ModuleShardingSpec],
    model: nn.Module,
    sequence: NamedPlacement | None = None,
    call: ExampleCall | None = None,
) -> None:
    """Raise for parameters no template claimed and no override declared either.

    ``sequence``: the layout of activations between blocks under sequence parallelism
    (None without it), for the fix that gives the parameters' module a boundary on it.
    """
    if not structure.unclaimed:
        return
    declared: set[str] = set()
    for fqn, spec in modules.items():
        params = spec.params if isinstance(spec.params, dict) else {}
        for rel in params:
            for src in spec._ep_stack.get(rel) or [rel]:
                declared.add(f"{fqn}.{src}" if fqn else src)
    missing = [f for f in structure.unclaimed if f not in declared]
    if not missing:
        return
    lines = "\n".join(
        f"  {f} ({structure.roles[f].value}, shape {structure.unclaimed[f][1]})"
        for f in missing[:10]
    )
    more = f"\n  ... and {len(missing) - 10} more" if len(missing) > 10 else ""
    owners: dict[str, list[str]] = {}
    for f in missing:
        mod = structure.unclaimed[f][0]
        owners.setdefault(mod, []).append(f[len(mod) + 1 :] if mod else f)
    entries = "".join(
        f"  - match: {mod!r}\n    is_boundary: false\n    params: {{"
        + ", ".join(f"{rel}: {{tp: replicate}}" for rel in rels)
        + "}\n"
        for mod, rels in owners.items()
    )
    why = "".join(f"\n({note})" for note in structure.notes)
    first = _token_wise(missing, structure, modules, model, sequence, call or default_call(model))
    raise propose(
        UncoveredParameterError(
            "no boundary template claims these parameters, so hp cannot know their layout:\n"
            f"{lines}{more}{why}\n"
            "Declare them in an override (kept whole, their modules' forwards not wrapped, or in "
            "a boundary that gives their layout), or register a RoleRule (or a ModuleRule) for "
            "your architecture through a plugin (docs/plugins.md)."
        ),
        *first,
        yaml_proposal(entries, f"keeping {', '.join(missing[:3])} whole on tp"),
    )


def _token_wise(
    missing: list[str],
    structure: ModelStructure,
    modules: Mapping[str, ModuleShardingSpec],
    model: nn.Module,
    sequence: NamedPlacement | None,
    call: ExampleCall,
) -> list[Proposal]:
    """The fix that makes each module holding ``missing`` parameters a boundary on the
    sequence shards (``sequence``), or none: without sequence parallelism, or where a
    parameter sits on a planned boundary that is not a local region of whole parameters.
    A parameter on a local region itself (a decoder layer's own scale: its children are
    boundaries, so its forward cannot also be one DTensor region) joins that region whole."""
    if sequence is None:
        return []
    owners: dict[str, list[str]] = {}
    entries = []
    local: dict[str, list[str]] = {}
    for f in missing:
        held = structure.unclaimed[f][0]
        mod = _outermost_free(held, modules)
        if mod is None:
            if not _local_region(modules.get(held)):
                return []
            local.setdefault(held, []).append(f[len(held) + 1 :])
            continue
        owners.setdefault(mod, []).append(f[len(mod) + 1 :])
    for mod, rels in local.items():
        # A layer's own scale: its forward already runs on this rank's sequence shards (the
        # layer is a local region that shards the stream at entry); kept whole there, the
        # contract rule sums its gradient over the shards (hp_core/runtime/partial.py).
        whole: dict[str, dict[str, Placement]] = {rel: _whole(sequence) for rel in rels}
        entries.append(OverrideEntry(mod, ModuleShardingSpec(params=whole)))
    try:
        calls = run_trace(model, call).calls if owners else {}
    except TraceFailedError:  # hp cannot see what these modules are given
        return []
    for mod, rels in owners.items():
        seen = calls.get(mod)
        if seen is None or not seen.args or seen.args[0] is None:
            return []  # not called, or not on a tensor: nothing a boundary could convert
        entry = _on_tokens(model.get_submodule(mod), seen, seen.args[0], sequence)
        entry.params = {rel: _whole(sequence) for rel in rels}
        entries.append(OverrideEntry(mod, entry))
    what = []
    if owners:
        what.append(f"giving {', '.join(list(owners)[:3])} a boundary on the sequence shards")
    if local:
        what.append(f"keeping the own parameters of {', '.join(list(local)[:3])} whole there")
    fix = yaml_proposal(entries_text(entries), ", and ".join(what))
    return [dataclasses.replace(fix, flags={"sequence_parallel": True})]  # not without SP


def _on_tokens(
    module: nn.Module, seen: ModuleCall, tokens: tuple[int, ...], sequence: NamedPlacement
) -> ModuleShardingSpec:
    """A contract that hands ``module`` every tensor shaped like its first input ``tokens``
    (the same batch and sequence: the residual stream, a branch joining it) as sequence
    shards, and takes back each such result the same way."""

    def per_token(shape: tuple[int, ...] | None) -> bool:
        return shape is not None and len(shape) == len(tokens) and shape[:2] == tokens[:2]

    names = positional_names(module)
    ins = {names[i]: dict(sequence) for i, s in enumerate(seen.args[: len(names)]) if per_token(s)}
    out_names = [f"output_{i}" for i in range(len(seen.results))] if seen.returned_tuple else None
    outs = {
        (out_names[i] if out_names else "output"): dict(sequence)
        for i, s in enumerate(seen.results)
        if per_token(s)
    }
    return ModuleShardingSpec(
        params={},
        in_src=ins,
        in_dst=dict(ins),
        out_src=outs,
        out_dst=dict(outs),
        out_names=out_names,
    )


def _whole(sequence: NamedPlacement) -> dict[str, Placement]:
    """Replicated on every axis the sequence is split on."""
    return {a: Replicate() for a in sequence}


def _local_region(spec: ModuleShardingSpec | None) -> bool:
    """A planned boundary whose forward runs on local tensors and shards no parameter (the
    decoder layer under sequence parallelism): its own parameters can join it kept whole."""
    return (
        spec is not None
        and spec.is_boundary
        and spec.region_dispatch is False
        and not spec.has_injection
        and all(
            isinstance(p, Replicate) for n in layout_map(spec.params).values() for p in n.values()
        )
    )


def _outermost_free(fqn: str, modules: Mapping[str, ModuleShardingSpec]) -> str | None:
    """The outermost module around ``fqn`` (itself included) that neither is nor holds a
    planned module, below one that does; None when ``fqn`` itself is or holds one."""

    def free(name: str) -> bool:
        return name != "" and not any(m == name or m.startswith(f"{name}.") for m in modules)

    if not free(fqn):
        return None
    while free(parent := fqn.rpartition(".")[0]):
        fqn = parent
    return fqn
