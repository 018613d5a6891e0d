"""Roles → blocks: find the boundaries of a model from its module tree and parameter names.

Works on meta-device models: only names, shapes and the module tree are read.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from hp_core.planner.infer_roles import Inference, infer_roles, is_linear_like
from hp_core.planner.lints import CoverageError
from hp_core.planner.templates.mla import latent_projections
from hp_core.planner.templates.module_rules import ModuleRule, kind_role
from hp_core.planner.templates.roles import Role, RoleRule, RoleSource, first_rule
from hp_core.planner.trace import FlowTrace, TraceFailedError
from hp_core.planner.trace import trace as run_trace
from hp_core.plans.example import ExampleCall, failed_call_error

__all__ = [
    "Block",
    "ModelStructure",
    "UncoveredParameterError",
    "analyse",
    "model_architectures",
    "positional_names",
]

_PROJECTION_ROLES = (Role.COLWISE, Role.ROWWISE, Role.FUSED_QKV, Role.FUSED_GATE_UP)
_ATTENTION_LEAVES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "query",
    "key",
    "value",
    "query_key_value",
    "c_attn",
    "Wqkv",
)


_STACKS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class UncoveredParameterError(CoverageError):
    """A parameter that no boundary template claims (the planner cannot guess its layout)."""


@dataclasses.dataclass
class Block:
    """One boundary candidate: a module, its kind, and the roles of the parameters it owns."""

    fqn: str
    kind: str
    module: nn.Module
    params: dict[str, Role]  # relative param path -> role
    shapes: dict[str, tuple[int, ...]]
    #: Rank of the activation a single-Linear block reads (the trace's, else 3: [B, S, H]).
    ndim: int = 3
    #: A single-Linear block split out of an attention block: the attention product runs
    #: in the enclosing layer's own code.
    in_attention: bool = False
    #: Whether the forward returned a tuple when the trace ran it (``None``: not traced;
    #: the return annotation decides).
    tuple_out: bool | None = None
    #: A norm whose caller reshapes its output with whole-sequence shapes: it hands its
    #: output over whole on tp (and the head reading it takes it whole).
    whole_out: bool = False
    whole_in: bool = False
    #: Whether its forward ran when the trace ran the model (``None``: not traced). A
    #: module whose forward never runs (minGPT's MLP is a ModuleDict its parent's code calls
    #: the children of) cannot be wrapped: a boundary there would never see its data.
    called: bool | None = None
    #: Later positional parameters the trace saw given the same tensor as the first: they
    #: are declared in the first one's layout (:attr:`FlowTrace.first_aliases`).
    first_aliases: tuple[str, ...] = ()


@dataclasses.dataclass
class ModelStructure:
    blocks: list[Block]
    roles: dict[str, Role]  # param FQN (every alias) -> role
    tied: dict[str, str]  # alias FQN -> first FQN of the same Parameter
    architectures: tuple[str, ...]
    module_names: list[str]
    #: Parameters no template claims: param FQN -> (owning module FQN, shape).
    unclaimed: dict[str, tuple[str, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    #: What the structural inference could not do (e.g. the meta trace failed).
    notes: list[str] = dataclasses.field(default_factory=list)
    #: Param FQN (every alias) → what decided its role (``hp_core.explain_roles``).
    sources: dict[str, RoleSource] = dataclasses.field(default_factory=dict)


def model_architectures(model: nn.Module) -> tuple[str, ...]:
    """HF ``config.architectures`` when present, else the model's class name."""
    cfg = getattr(model, "config", None)
    archs = getattr(cfg, "architectures", None) or ()
    return tuple(archs) or (type(model).__name__,)


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def positional_names(module: nn.Module) -> list[str]:
    """The names of ``module.forward``'s positional parameters, in order."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # pragma: no cover - every nn.Module forward is introspectable
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _first_input(module: nn.Module) -> str:
    names = positional_names(module)
    return names[0] if names else "input"


def first_input_name(module: nn.Module) -> str:
    """The name of the first positional parameter of ``module.forward``."""
    return _first_input(module)


def returns_tuple(module: nn.Module) -> bool:
    """Whether ``module.forward`` is annotated to return a tuple (the fallback where the
    trace did not run it: :attr:`Block.tuple_out`)."""
    try:
        ann = inspect.signature(module.forward).return_annotation
    except (TypeError, ValueError):  # pragma: no cover
        return False
    text = ann if isinstance(ann, str) else repr(ann)
    return text.startswith(("tuple", "typing.Tuple", "Tuple"))


def _ancestors(fqn: str) -> list[str]:
    """``"a.b.c"`` → ``["a.b", "a", ""]``: every enclosing module path, innermost first."""
    out = []
    while fqn:
        fqn = _parent(fqn)
        out.append(fqn)
    return out


def _split_enclosing(
    pair_roots: dict[str, str],
    leaves: dict[str, dict[str, Role]],
    modules: dict[str, nn.Module],
    split_attention: set[str],
) -> dict[str, str]:
    """An MLP "block" that encloses an attention block is a decoder layer whose MLP has no
    module of its own (OPT, BioGPT: ``fc1``/``fc2`` beside ``self_attn``), and a block that
    is an element of a layer stack holds the residual add too: each of their column/row-
    parallel Linears becomes a boundary of its own instead."""
    attention = [r for r, k in pair_roots.items() if k == "attention"]
    stacks = {f for f, m in modules.items() if isinstance(m, _STACKS)}
    out: dict[str, str] = {}
    for root, kind in pair_roots.items():
        encloses = kind == "mlp" and any(
            a != root and (not root or a.startswith(root + ".")) for a in attention
        )
        # A stack element is a decoder layer: its residual add sits beside the projections.
        is_layer = bool(root) and _parent(root) in stacks and root.rpartition(".")[2].isdigit()
        linears = leaves.get(root, {})
        if not (
            (encloses or is_layer)
            and linears
            and all(
                is_linear_like(modules[leaf]) and role in (Role.COLWISE, Role.ROWWISE)
                for leaf, role in linears.items()
            )
        ):
            out[root] = kind
            continue
        for leaf, role in linears.items():
            out[leaf] = "linear_colwise" if role is Role.COLWISE else "linear_rowwise"
            if kind == "attention":
                split_attention.add(leaf)
    return out


def _claim_pass(
    params: Iterable[str],
    roots: dict[str, str],
    claimed: dict[str, tuple[str, str]],
    *,
    inclusive_owner: dict[str, str],
) -> None:
    """Give every unclaimed parameter under one of ``roots`` (first registered wins) to it.

    Linear in the number of parameters times the module depth: each parameter looks up
    its own ancestors instead of every root scanning every parameter.
    """
    order = {root: i for i, root in enumerate(roots)}
    for fqn in params:
        if fqn in claimed:
            continue
        best = None
        for anc in [inclusive_owner[fqn], *_ancestors(inclusive_owner[fqn])]:
            i = order.get(anc)
            if i is not None and (best is None or i < order[best]):
                best = anc
        if best is not None:
            claimed[fqn] = (best, roots[best])


def _named_rule(
    fqn: str, scoped: list[RoleRule], general: list[RoleRule], archs: tuple[str, ...]
) -> tuple[RoleRule | None, bool]:
    """``(rule, decisive)``: a scoped rule decides; a general one is a hint; none: ``None``."""
    rule = first_rule(fqn, scoped, archs) if scoped else None
    if rule is not None:
        return rule, True
    return first_rule(fqn, general, archs), False


_UNCLAIMED = RoleSource("unclaimed", "unclaimed (no rule; replicated)")


def _decide_roles(
    model: nn.Module,
    params: dict[str, str],
    rules: list[RoleRule],
    module_rules: list[ModuleRule],
    archs: tuple[str, ...],
    call: ExampleCall | None,
) -> tuple[dict[str, Role], Inference, dict[str, RoleSource]]:
    """Every parameter's role: scoped name rules, then ModuleRules, general name rules
    (hints), then structure (:mod:`~hp_core.planner.infer_roles`) for the rest; and what
    decided each one."""
    scoped = [r for r in rules if r.architectures]
    general = [r for r in rules if not r.architectures]
    inferred = infer_roles(model, [], module_rules, archs)  # module kinds only
    roles: dict[str, Role] = {}
    sources: dict[str, RoleSource] = {}
    undecided: list[str] = []
    whole = {m: k for m, k in inferred.kinds.items() if kind_role(k) or k == "keep"}
    for fqn, owner in params.items():
        rule, decisive = _named_rule(fqn, scoped, general, archs)
        role = rule.role if rule is not None else None
        declared = [a for a in (owner, *_ancestors(owner)) if a in whole] if whole else []
        kind = whole[declared[0]] if declared else None
        if rule is not None:
            via = "role_rule" if decisive else "name_hint"
            text = rule.name if decisive else f"name hint {rule.name}"
            sources[fqn] = RoleSource(via, text, rule.name)
        if not decisive and kind is not None:
            role = kind_role(kind) or Role.REPLICATED
            by = inferred.kind_rules[declared[0]].name
            sources[fqn] = RoleSource("module_rule", by, by)
        if role is None:
            undecided.append(fqn)
            role = Role.REPLICATED
            sources[fqn] = _UNCLAIMED
        roles[fqn] = role
    if undecided or any(k in ("attention", "mlp") for k in inferred.kinds.values()):
        inferred = infer_roles(model, undecided, module_rules, archs, call)
        roles.update(inferred.roles)
        sources.update(inferred.sources)
    return roles, inferred, sources


def analyse(
    model: nn.Module,
    rules: Iterable[RoleRule],
    module_rules: Iterable[ModuleRule] = (),
    call: ExampleCall | None = None,
) -> ModelStructure:
    """Classify every parameter and group them into blocks (docs/plans.md, steps 1-2);
    ``call`` is the forward call the dataflow trace runs (default: hp's default call)."""
    rules = list(rules)
    archs = model_architectures(model)
    modules = dict(model.named_modules())
    roles: dict[str, Role] = {}
    owner: dict[str, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    first_by_id: dict[int, str] = {}
    for mfqn, mod in modules.items():
        for pname, p in mod._parameters.items():
            if p is None:
                continue
            fqn = f"{mfqn}.{pname}" if mfqn else pname
            owner[fqn] = mfqn
            tensors[fqn] = p
            if id(p) in first_by_id:
                tied[fqn] = first_by_id[id(p)]
            else:
                first_by_id[id(p)] = fqn
    roles, inferred, sources = _decide_roles(model, owner, rules, list(module_rules), archs, call)

    claimed: dict[str, tuple[str, str]] = {}  # param fqn -> (block fqn, kind)

    # 1. MoE blocks: the parent of the experts container / of the router module.
    found: dict[str, None] = {}
    for fqn, role in roles.items():
        root = None
        if role is Role.MOE_EXPERT:
            head, sep, _ = fqn.partition(".experts.")
            root = head if sep else _parent(_parent(fqn))
        elif role is Role.MOE_ROUTER:
            root = _parent(owner[fqn])
        if root is not None:
            found.setdefault(root, None)
    # Keep outermost roots only (a router inside the experts' parent is the same block).
    moe_roots = {r: "moe" for r in found if not any(a in found for a in _ancestors(r))}
    _claim_pass(roles, moe_roots, claimed, inclusive_owner=owner)

    # 2. Attention / MLP: the parent of each projection leaf, outside MoE blocks.
    pair_roots: dict[str, str] = {}
    leaves: dict[str, dict[str, Role]] = {}  # root -> projection leaf -> role
    for fqn, role in roles.items():
        if fqn in claimed or role not in _PROJECTION_ROLES:
            continue
        leaf = owner[fqn]
        root = _parent(leaf)
        leaves.setdefault(root, {}).setdefault(leaf, role)
        if root not in pair_roots:
            pair_roots[root] = "mlp"
        if (
            role is Role.FUSED_QKV
            or leaf.rpartition(".")[2] in _ATTENTION_LEAVES
            or leaf in inferred.attention
        ):
            pair_roots[root] = "attention"
        elif root in modules and latent_projections(modules[root]) is not None:
            pair_roots[root] = "attention"  # MLA: no leaf named like a q/k/v projection
    for root, kind in inferred.kinds.items():
        if root in pair_roots and kind in ("attention", "mlp"):
            pair_roots[root] = kind
    split_attention: set[str] = set()
    pair_roots = _split_enclosing(pair_roots, leaves, modules, split_attention)
    _claim_pass(roles, pair_roots, claimed, inclusive_owner=owner)

    # 3. Embedding, lm_head, norms: their owning module (and whatever lies under it).
    leaf_roots: dict[str, str] = {}
    for wanted, kind in ((Role.EMBED, "embed"), (Role.LM_HEAD, "lm_head"), (Role.NORM, "norm")):
        for fqn, role in roles.items():
            if role is wanted and fqn not in claimed:
                leaf_roots.setdefault(owner[fqn], kind)
    _claim_pass(roles, leaf_roots, claimed, inclusive_owner=owner)
    keep_roots = {m: "keep" for m, k in inferred.kinds.items() if k == "keep"}
    _claim_pass(roles, keep_roots, claimed, inclusive_owner=owner)

    # Parameters no template claims: an override may still declare them (checked after
    # the merge by check_unclaimed), so they are recorded here, not rejected.
    unclaimed = {
        f: (owner[f], tuple(tensors[f].shape))
        for f, r in roles.items()
        if f not in claimed and r is not Role.SKIP and f not in tied
    }

    # 4. Decoder layers (the sequence-parallel entry): the parent of each attention block,
    #    and every element of a layer stack that holds an attention, MLP or MoE block (a
    #    hybrid model's linear-attention layer has no attention block that names itself so,
    #    and its layer must shard the residual stream like the others).
    layer_roots: list[str] = []
    stacks = {
        f
        for f, m in modules.items()
        if isinstance(m, nn.ModuleList | nn.ModuleDict | nn.Sequential)
    }
    for r, kind in [*pair_roots.items(), *moe_roots.items()]:
        layer = _parent(r)
        in_stack = _parent(layer) in stacks and layer.rpartition(".")[2].isdigit()
        if (
            layer
            and layer not in layer_roots
            and layer in modules
            and (kind == "attention" or in_stack)
        ):
            layer_roots.append(layer)

    kinds: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    for fqn, (root, kind) in claimed.items():
        kinds.setdefault(root, kind)
        members.setdefault(root, []).append(fqn)
    for layer in layer_roots:
        kinds.setdefault(layer, "layer")
    blocks: list[Block] = []
    for mfqn in modules:  # model order
        if mfqn not in kinds:
            continue
        params: dict[str, Role] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for fqn in members.get(mfqn, ()):
            rel = fqn[len(mfqn) + 1 :] if mfqn else fqn
            params[rel] = roles[fqn]
            shapes[rel] = tuple(tensors[fqn].shape)
        ndim = inferred.ndims.get(mfqn, 3)
        blocks.append(
            Block(mfqn, kinds[mfqn], modules[mfqn], params, shapes, ndim, mfqn in split_attention)
        )
    flows = inferred.flows
    if flows is None and _outputs_unclear(blocks, modules):
        flows = _light_trace(model, call)
    _mark_outputs(blocks, flows)
    return ModelStructure(
        blocks, roles, tied, archs, list(modules), unclaimed, inferred.notes, sources
    )


def _forward_source(module: nn.Module) -> str | None:
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):  # no source (built in, generated): the trace decides
        return None


def _outputs_unclear(blocks: list[Block], modules: Mapping[str, nn.Module]) -> bool:
    """Whether only the trace can tell what the blocks hand over: an attention forward with
    no return annotation, or a norm whose caller's code may reshape its output (a hint from
    the source text: ``.view(``/``.reshape(`` in that forward; the trace decides)."""
    seen: set[tuple[str, type]] = set()  # one look per class: same code, same answer
    for b in blocks:
        owner = modules.get(_parent(b.fqn)) if b.kind == "norm" else b.module
        if owner is None or b.kind not in ("attention", "norm") or (b.kind, type(owner)) in seen:
            continue
        seen.add((b.kind, type(owner)))
        if b.kind == "attention":
            if inspect.signature(owner.forward).return_annotation is inspect.Signature.empty:
                return True
            continue
        src = _forward_source(owner)
        if src is None or ".view(" in src or ".reshape(" in src:
            return True
    return False


def _light_trace(model: nn.Module, call: ExampleCall | None) -> FlowTrace | None:
    """The trace for output structure alone, where roles needed none; ``None`` if the forward
    cannot run on meta (the annotations decide, and the final norm stays sequence-sharded).
    A call the user gave that fails is an error: they asked for exactly that call."""
    try:
        return run_trace(model, call)
    except TraceFailedError as e:
        if call is not None and call.given:
            raise failed_call_error(model, call, e) from e
        return None


def _mark_outputs(blocks: list[Block], flows: FlowTrace | None) -> None:
    """What the blocks' forwards return, and which final norm must hand its output over whole
    (docs/plans.md: a head fed by model code that reshapes the norm's output). A module with
    no forward of its own (a ModuleDict) is never called, traced or not."""
    for b in blocks:
        if type(b.module).forward is nn.Module.forward:
            b.called = False
    if flows is None:
        return
    for b in blocks:
        b.tuple_out = flows.tuple_outputs.get(b.fqn)
        b.called = b.called is not False and b.fqn in flows.tuple_outputs
        b.first_aliases = flows.first_aliases.get(b.fqn, ())
    norms = {b.fqn: b for b in blocks if b.kind == "norm"}
    for b in blocks:
        flow = flows.projections.get(b.fqn)
        if b.kind != "lm_head" or flow is None or not flow.norms:
            continue
        if all(n in norms and n in flows.reshaped_norms for n in flow.norms):
            b.whole_in = True
            for n in flow.norms:
                norms[n].whole_out = True
