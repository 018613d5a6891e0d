"""Roles from structure: what a parameter is, from its module's type, shapes and dataflow.

Name rules (:mod:`~hp_core.planner.templates.roles`) decide first; what they leave
undecided is inferred here:

- a module a :class:`~hp_core.planner.templates.module_rules.ModuleRule` names gets
  that kind;
- ``nn.Embedding``: the one that looks up the input ids is the (vocab-parallel)
  embedding; any other (positions, token types) is kept whole;
- a norm module (LayerNorm/RMSNorm-like, :func:`~hp_core.planner.trace.is_norm_module`)
  is a norm;
- a Linear-like module (``nn.Linear``, transformers' ``Conv1D``): from the dataflow trace
  (:mod:`~hp_core.planner.trace`). Projections feeding the attention product are
  column-parallel (one that feeds it twice is a fused q/k/v); one consuming the attention
  product is row-parallel; a projection consuming only projections that read the
  residual stream is row-parallel and those are column-parallel (a producer twice as
  wide as its consumer's input is a fused gate/up); the last projection to the vocabulary
  is the head. Widths are checked against the hidden size: an entry reads it, an exit
  writes it back.

A forward that cannot run on meta leaves Linear-like modules undecided (the caller
refuses what stays unclaimed) and records a note.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from torch import nn

from hp_core.planner.templates.module_rules import ModuleRule, kind_role, module_rule
from hp_core.planner.templates.roles import Role, RoleSource
from hp_core.planner.trace import ATTN, FlowTrace, TraceFailedError, is_norm_module, producers
from hp_core.planner.trace import trace as run_trace
from hp_core.plans.example import ExampleCall, failed_call_error

__all__ = ["Inference", "infer_roles", "is_linear_like"]

_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "dim", "embed_dim")


@dataclasses.dataclass
class Inference:
    """What structure decided: roles of undecided parameters, module kinds, notes."""

    roles: dict[str, Role] = dataclasses.field(default_factory=dict)
    #: Projection modules the trace saw feed or consume the attention product.
    attention: set[str] = dataclasses.field(default_factory=set)
    #: Module FQN → kind, from ModuleRules and inference (``keep``: stays whole).
    kinds: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Module FQN → the ModuleRule that declared its kind.
    kind_rules: dict[str, ModuleRule] = dataclasses.field(default_factory=dict)
    #: Param FQN → what decided the role in :attr:`roles` (for ``explain_roles``).
    sources: dict[str, RoleSource] = dataclasses.field(default_factory=dict)
    #: Projection module FQN → rank of the activation it reads.
    ndims: dict[str, int] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    #: The dataflow trace, when it ran (``None``: every role was decided without it).
    flows: FlowTrace | None = None


def is_linear_like(module: nn.Module) -> bool:
    """``nn.Linear``, or transformers' ``Conv1D`` (weight stored ``[in, out]``)."""
    if isinstance(module, nn.Linear):
        return True
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 2
        and hasattr(module, "nf")
    )


def _config_int(model: nn.Module, keys: Sequence[str]) -> int | None:
    cfg = getattr(model, "config", None)
    for key in keys:
        value = getattr(cfg, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _linear_roles(flows: FlowTrace, hidden: int | None, vocab: int | None) -> dict[str, Role]:
    """Module FQN → role of each traced projection the flow decides."""
    out: dict[str, Role] = {}
    fl = flows.projections
    heads = [f for f in fl.values() if vocab is not None and f.out_width == vocab]
    if heads:
        last = max(heads, key=lambda f: f.order)
        if ATTN not in last.inputs and not last.feeds_attention and hidden in (None, last.in_width):
            out[last.fqn] = Role.LM_HEAD

    def reads_stream(fqn: str) -> bool:
        f = fl[fqn]
        return not producers(f) and ATTN not in f.inputs and (hidden in (None, f.in_width))

    def writes_stream(fqn: str) -> bool:
        return hidden in (None, fl[fqn].out_width)

    for f in fl.values():
        if f.fqn in out:
            continue
        if f.feeds_attention and reads_stream(f.fqn):
            out[f.fqn] = Role.FUSED_QKV if f.fused_attention else Role.COLWISE
        elif ATTN in f.inputs and writes_stream(f.fqn):
            out[f.fqn] = Role.ROWWISE
    for f in fl.values():
        made = producers(f)
        if f.fqn in out or not made or not writes_stream(f.fqn):
            continue
        if all(p in fl and reads_stream(p) and not fl[p].feeds_attention for p in made):
            out[f.fqn] = Role.ROWWISE
            for p in made:
                fused = len(made) == 1 and fl[p].out_width == 2 * f.in_width
                out.setdefault(p, Role.FUSED_GATE_UP if fused else Role.COLWISE)
    return out


def infer_roles(
    model: nn.Module,
    undecided: Iterable[str],
    module_rules: Iterable[ModuleRule] = (),
    architectures: Sequence[str] = (),
    call: ExampleCall | None = None,
) -> Inference:
    """Roles for the parameters in ``undecided`` (param FQNs) that structure can decide."""
    undecided = list(undecided)
    module_rules = list(module_rules)
    inf = Inference()
    modules = dict(model.named_modules())
    for fqn, mod in modules.items():
        rule = module_rule(fqn, mod, module_rules, architectures) if module_rules else None
        if rule is not None:
            inf.kinds[fqn] = rule.kind
            inf.kind_rules[fqn] = rule
    if not undecided:
        return inf
    owners = {p: p.rpartition(".")[0] for p in undecided}
    flows: FlowTrace | None = None
    if any(
        is_linear_like(modules[o]) or isinstance(modules[o], nn.Embedding) for o in owners.values()
    ):
        try:
            flows = run_trace(model, call)
        except TraceFailedError as e:
            if call is not None and call.given:
                raise failed_call_error(model, call, e) from e
            inf.notes.append(
                f"roles from structure: the meta-device dataflow trace of {type(model).__name__} "
                f"could not run ({str(e)[:200]}); projections were classified by type, shape and "
                "name only"
            )
    embeds = [m for m in modules.values() if isinstance(m, nn.Embedding)]
    token_embeds = (
        {f for f, reads_ids in flows.embeddings.items() if reads_ids}
        if flows is not None
        else set()
    )
    vocab = _config_int(model, ("vocab_size",))
    if vocab is None and embeds:
        vocab = max(m.num_embeddings for m in embeds)
    hidden = _config_int(model, _HIDDEN_KEYS)
    if hidden is None and embeds:
        hidden = max(embeds, key=lambda m: m.num_embeddings).embedding_dim
    inf.flows = flows
    linear = _linear_roles(flows, hidden, vocab) if flows is not None else {}
    if flows is None:  # no flow: only the head is evident from shapes (the last Linear to vocab)
        last = [f for f, m in modules.items() if is_linear_like(m) and _out(m) == vocab]
        if last and _in(modules[last[-1]]) == hidden:
            linear[last[-1]] = Role.LM_HEAD
    for fqn in undecided:
        owner = owners[fqn]
        mod = modules[owner]
        kind = inf.kinds.get(owner)
        role = kind_role(kind) if kind is not None else None
        declared = inf.kind_rules.get(owner)
        source = RoleSource("module_rule", declared.name, declared.name) if declared else None
        if kind == "keep":
            role = Role.REPLICATED
        elif role is None and kind is None:
            role = _by_type(owner, mod, linear, token_embeds, flows is not None, vocab)
            source = RoleSource("structure", _why(mod, role, flows is not None))
            if role is Role.REPLICATED:
                inf.kinds[owner] = "keep"
        if role is not None:
            inf.roles[fqn] = role
            if source is not None:
                inf.sources[fqn] = source
    if flows is not None:
        inf.attention = {
            f.fqn for f in flows.projections.values() if f.feeds_attention or ATTN in f.inputs
        }
        inf.ndims = {f.fqn: f.in_ndim for f in flows.projections.values()}
    return inf


def _by_type(
    owner: str,
    mod: nn.Module,
    linear: dict[str, Role],
    token_embeds: set[str],
    traced: bool,
    vocab: int | None,
) -> Role | None:
    if isinstance(mod, nn.Embedding):
        is_token = owner in token_embeds if traced else mod.num_embeddings == vocab
        return Role.EMBED if is_token else Role.REPLICATED
    if is_norm_module(mod):
        return Role.NORM
    if is_linear_like(mod):
        return linear.get(owner)
    return None


def _why(mod: nn.Module, role: Role | None, traced: bool) -> str:
    """What in the structure decided a role ``_by_type`` returned, in words."""
    if isinstance(mod, nn.Embedding):
        how = "trace: " if traced else "size: "
        what = (
            "not the token embedding, kept whole" if role is Role.REPLICATED else "token embedding"
        )
        return f"structure ({how}{what})"
    if is_norm_module(mod):
        return "structure (norm module)"
    return "structure (trace)" if traced else "structure (shape: projection to the vocabulary)"


def _out(mod: nn.Module) -> int | None:
    return int(mod.out_features) if isinstance(mod, nn.Linear) else int(getattr(mod, "nf", 0))


def _in(mod: nn.Module) -> int | None:
    if isinstance(mod, nn.Linear):
        return int(mod.in_features)
    weight = getattr(mod, "weight", None)
    return int(weight.shape[0]) if weight is not None else None
