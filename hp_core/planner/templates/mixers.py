"""Blocks hp cannot split over tp: kept whole, exactly, with a plan note saying why.

A projection block is split Megatron-style when it reads the hidden state through
column-parallel projections and writes it back through row-parallel ones. Two kinds of
block do not fit, and are planned whole on tp (every parameter replicated, the input
gathered, the output whole — exact, at the cost of replicated compute):

* a *mixer* hp does not know: a row-parallel output projection but no column-parallel
  input (Qwen3-Next's gated DeltaNet, Mamba-style mixers: fused input projections,
  convolutions, per-head decay parameters hp has no rule for);
* a block whose submodules hold learned parameters that are neither projections nor
  norms (Apertus' xIELU activation scalars): their gradients run through nonlinear
  code on sharded activations, where DTensor would have to communicate.

To shard such a block, a plugin declares what hp cannot infer: ``RoleRule``\\ s for its
projections, or a ``BoundaryTemplate`` for the block, scoped to the architecture and
registered through ``hp_register_templates`` (docs/plugins.md).
"""

from __future__ import annotations

import inspect

from torch import nn

from hp_core.planner.structure import Block
from hp_core.planner.templates.context import TemplateContext
from hp_core.planner.templates.mla import latent_projections
from hp_core.planner.templates.per_head import per_head_params
from hp_core.planner.templates.roles import Role
from hp_core.spec.module_spec import ModuleShardingSpec

__all__ = ["kept_whole_note", "whole_block", "whole_reason"]

_INPUT_ROLES = (Role.COLWISE, Role.FUSED_QKV, Role.FUSED_GATE_UP)
_PAIR_KINDS = ("attention", "mlp")


def _owner(block: Block, rel: str) -> nn.Module:
    path = rel.rpartition(".")[0]
    return block.module.get_submodule(path) if path else block.module


def second_activation(module: nn.Module) -> str | None:
    """A required positional input of ``module``'s forward after the first (MPT's MLP takes
    ``residual`` and adds it to its row-parallel output itself), or None."""
    params = list(inspect.signature(module.forward).parameters.values())
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    rest = [p for p in params if p.kind in kinds][1:]
    return next((p.name for p in rest if p.default is inspect.Parameter.empty), None)


def whole_reason(block: Block) -> str | None:
    """Why ``block`` cannot be split over tp, or None when it can."""
    if block.kind not in _PAIR_KINDS or latent_projections(block.module) is not None:
        return None
    extra = second_activation(block.module) if block.kind == "mlp" else None
    if extra is not None:
        # What it does with the second one is unknown: added after the row-parallel exit, it
        # would be counted tp times. Whole, the block's own code computes it once.
        return (
            f"its forward takes a second activation {extra!r}, which a split MLP contract "
            "cannot declare (added to the row-parallel output on every rank, the exit "
            "reduction would count it tp times)"
        )
    if not any(r in _INPUT_ROLES for r in block.params.values()):
        unknown = [r for r, role in block.params.items() if role is Role.REPLICATED]
        return (
            "it has no column-parallel input projection hp recognises (parameters without a "
            f"role: {', '.join(unknown[:6]) or 'none'})"
        )
    per_head = set(per_head_params(block))
    odd = [
        rel
        for rel, role in block.params.items()
        if role is Role.REPLICATED
        and rel not in per_head
        and "." in rel
        and not isinstance(_owner(block, rel), nn.Linear)
    ]
    if odd:
        kinds = sorted({type(_owner(block, r)).__name__ for r in odd})
        return (
            f"its {'/'.join(kinds)} submodule holds learned parameters ({', '.join(odd[:6])}) "
            "that are neither projections nor norms; their gradients pass through nonlinear "
            "code on the sharded activations, where DTensor would have to communicate"
        )
    return None


def kept_whole_note(block: Block) -> str | None:
    """The plan note for a block kept whole on tp (None when it is split)."""
    why = whole_reason(block)
    if why is None:
        return None
    return (
        f"{block.fqn} ({type(block.module).__name__}) is kept whole on tp: {why}. It runs "
        "replicated (exact, at the cost of replicated compute). To shard it, a plugin registers "
        "RoleRules for its projections or a BoundaryTemplate for its kind, scoped to "
        "the architecture (hp_register_templates, docs/plugins.md)."
    )


def whole_block(ctx: TemplateContext, out: str, out_names: list[str] | None) -> ModuleShardingSpec:
    """The spec of a block kept whole on tp: replicated parameters, whole input and output."""
    params = {rel: ctx.replicated() for rel in ctx.block.params}
    return ModuleShardingSpec(
        params={k: v for k, v in params.items() if v},
        in_src=ctx.inputs_io(ctx.hidden),
        in_dst=ctx.inputs_io(ctx.gathered),
        out_src=ctx.io(out, ctx.gathered),
        out_dst=ctx.io(out, ctx.hidden),
        out_names=out_names,
        # Everything is whole, so the module's own code runs on local tensors in both modes
        # (a mixer's code need not dispatch through DTensor) and no gradient is partial.
        region_dispatch=False,
    )
