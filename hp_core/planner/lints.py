"""Checks of a finished plan against the model and the mesh (docs/plans.md, step 5).

Each failure is a specific ``PlanningError`` whose message names the module, the rule
and the fix.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from hp_core.mesh import MeshSpec, MeshSpecError
from hp_core.planner.local_width import INPUT_WIDTH
from hp_core.planner.templates.roles import Role
from hp_core.plans.errors import ArgumentTypeError, PlanError
from hp_core.plans.fixes import keep_whole_proposals
from hp_core.plans.proposal import propose
from hp_core.spec.axes import CANONICAL_AXES
from hp_core.spec.keywords import close_matches
from hp_core.spec.module_spec import ModuleShardingSpec
from hp_core.spec.placements import format_placement

__all__ = [
    "HEAD_COUNT_ATTRS",
    "CoverageError",
    "DivisibilityError",
    "FusedProjectionError",
    "MeshAxisError",
    "MeshTypeError",
    "PlanningError",
    "TemplateBuildError",
    "attr_value",
    "compute_deferred_biases",
    "compute_tp_local_attrs",
    "input_width",
    "is_conv1d",
    "lint_plan",
]

#: Integer attributes that count attention heads; divided by tp when q/k/v are tp-sharded.
HEAD_COUNT_ATTRS = (
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_heads",
    "n_head",
    "n_kv_heads",
)
#: What the forward of a fused q/k/v projection reads besides the head counts: the width of
#: the query part (GPT-2's ``split_size``, DBRX's ``hidden_size``), and (on a private copy of
#: the module's config) the config's head counts.
FUSED_QKV_ATTRS = (
    "split_size",
    "hidden_size",
    "config.num_attention_heads",
    "config.num_key_value_heads",
)
_Q_NAMES = ("q_proj", "query")
_KV_NAMES = ("k_proj", "v_proj", "key", "value")


class PlanningError(PlanError):
    """The planner cannot produce a valid plan for this model, mesh and overrides."""


class DivisibilityError(PlanningError):
    """A sharded dimension or a head count that the axis size does not divide."""


class CoverageError(PlanningError):
    """A parameter that no boundary, or more than one, declares."""


class MeshAxisError(PlanningError):
    """A placement on an axis the mesh lacks, or on a data-parallel axis."""


class FusedProjectionError(PlanningError):
    """A fused projection (qkv / gate_up) that plain ``Shard(0)`` cannot split correctly."""


class TemplateBuildError(PlanningError):
    """A boundary template raised while building a module's spec; the original is ``__cause__``.

    ``template``, ``provider`` and ``fqn`` name the template, who registered it and the module.
    """

    def __init__(
        self, message: str, *, template: str = "", provider: str = "", fqn: str = ""
    ) -> None:
        super().__init__(message)
        self.template = template
        self.provider = provider
        self.fqn = fqn


class MeshTypeError(ArgumentTypeError, MeshSpecError):
    """``plan(model, mesh)`` with a mesh of a type hp cannot read (None, a number, a list...)."""


def _fmt(named: Mapping[str, Placement]) -> str:
    return "{" + ", ".join(f"{a}: {format_placement(p)}" for a, p in named.items()) + "}"


def _module(model: nn.Module, fqn: str) -> nn.Module:
    return model.get_submodule(fqn) if fqn else model


def _param(module: nn.Module, rel: str) -> torch.Tensor | None:
    path, _, name = rel.rpartition(".")
    try:
        owner = module.get_submodule(path) if path else module
    except AttributeError:
        return None
    p = owner._parameters.get(name)
    return p


def _layouts(spec: ModuleShardingSpec) -> list[tuple[str, Mapping[str, Placement]]]:
    out: list[tuple[str, Mapping[str, Placement]]] = []
    for field in ("params", "in_src", "in_dst", "out_src", "out_dst"):
        value = getattr(spec, field)
        if isinstance(value, dict):
            out.extend((f"{field}.{k}", v) for k, v in value.items())
    if isinstance(spec.inner_out_src, dict):
        out.extend((f"inner_out_src.{k}", v) for k, v in spec.inner_out_src.items())
    return out


def _check_axes(fqn: str, spec: ModuleShardingSpec, mesh: MeshSpec) -> None:
    for where, named in _layouts(spec):
        for axis in named:
            if axis.startswith("dp"):
                raise MeshAxisError(
                    f"{fqn}.{where}: places on the data-parallel axis {axis!r}. dp stays outside "
                    "the plan (FSDP/DDP own it); a plan describes one data-parallel slice. Remove "
                    f"the {axis!r} entry."
                )
            if axis == "ep" and spec._ep_size > 1:
                continue  # the derived expert mesh (edp, ep)
            if axis not in mesh:
                # A canonical axis (cp, ep, ...) is not a typo of another one.
                best = [] if axis in CANONICAL_AXES else close_matches(axis, mesh.axis_names, n=1)
                hint = f" Did you mean {best[0]!r}?" if best else ""
                raise MeshAxisError(
                    f"{fqn}.{where}: axis {axis!r} is not a dimension of the mesh {mesh}.{hint} "
                    f"Add the axis to the mesh, or guard the override with 'when: {axis}' so it "
                    "applies only when that axis is active."
                )


def _check_params(model: nn.Module, fqn: str, spec: ModuleShardingSpec, mesh: MeshSpec) -> None:
    module = _module(model, fqn)
    params = spec.params if isinstance(spec.params, dict) else {}
    own = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    for rel, named in params.items():
        stacked = spec._ep_stack.get(rel)
        if stacked:
            first = _param(module, stacked[0])
            shape: tuple[int, ...] = (
                (len(stacked), *tuple(first.shape)) if first is not None else ()
            )
        else:
            p = _param(module, rel)
            if p is None:
                best = close_matches(rel, own, n=1)
                hint = f" Did you mean {best[0]!r}?" if best else ""
                raise PlanningError(
                    f"{fqn}.params: {rel!r} is not a parameter of {fqn or 'the model'!r} "
                    f"({type(module).__name__}).{hint} Parameters there: {own[:8]}"
                )
            shape = tuple(p.shape)
        for axis, placement in named.items():
            if isinstance(placement, Partial):
                raise PlanningError(
                    f"{fqn}.params.{rel}.{axis}: a parameter cannot be 'partial'; use shard(N) or "
                    "replicate."
                )
            if not isinstance(placement, Shard):
                continue
            size = spec._ep_size if axis == "ep" and spec._ep_size > 1 else mesh.size(axis)
            if placement.dim >= len(shape):
                raise DivisibilityError(
                    f"{fqn}.params.{rel}.{axis}: shard({placement.dim}) on a {len(shape)}-D "
                    f"parameter of shape {shape}; valid dims are 0..{len(shape) - 1}."
                )
            if shape[placement.dim] % size:
                raise DivisibilityError(
                    f"{fqn}.params.{rel}.{axis}: dim {placement.dim} of shape {shape} has size "
                    f"{shape[placement.dim]}, which {axis}={size} does not divide. Choose a {axis} "
                    f"size that divides {shape[placement.dim]}, or replicate this parameter."
                )


def _head_dim(module: nn.Module) -> int | None:
    cfg = getattr(module, "config", None)
    for hd in (getattr(module, "head_dim", None), getattr(cfg, "head_dim", None)):
        if isinstance(hd, int) and hd > 0:
            return hd
    n, hidden = getattr(cfg, "num_attention_heads", None), getattr(cfg, "hidden_size", None)
    return hidden // n if isinstance(n, int) and isinstance(hidden, int) and n > 0 else None


def _tp_sharded_heads(spec: ModuleShardingSpec) -> list[str]:
    params = spec.params if isinstance(spec.params, dict) else {}
    out = []
    for rel, named in params.items():
        leaf = rel.rpartition(".")[0].rpartition(".")[2]
        if (
            leaf in _Q_NAMES + _KV_NAMES
            and isinstance(named.get("tp"), Shard)
            and rel.endswith("weight")
        ):
            out.append(rel)
    return out


def _check_heads(model: nn.Module, fqn: str, spec: ModuleShardingSpec, mesh: MeshSpec) -> None:
    tp = mesh.size("tp")
    if tp <= 1:
        return
    module = _module(model, fqn)
    hd = _head_dim(module)
    if hd is None:
        return
    for rel in _tp_sharded_heads(spec):
        p = _param(module, rel)
        if p is None:  # pragma: no cover - _check_params ran first
            continue
        heads = p.shape[0] // hd
        if heads % tp:
            kind = "query" if rel.rpartition(".")[0].rpartition(".")[2] in _Q_NAMES else "key/value"
            why = f"{heads} {kind} heads ({rel}: {tuple(p.shape)}, head_dim {hd}) cannot be split"
            raise propose(
                DivisibilityError(
                    f"{fqn}: {why} over tp={tp}. Each rank must hold whole heads.\nFix: choose a "
                    f"tp size that divides {heads}, or keep {fqn} whole on tp."
                ),
                *keep_whole_proposals(fqn, spec),
            )


def attr_value(module: nn.Module, attr: str) -> int | None:
    """``module.<attr>`` (a dotted path: ``config.num_attention_heads``) when an int, else None."""
    value: Any = module
    for part in attr.split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _conv1d_widths(module: nn.Module, spec: ModuleShardingSpec) -> list[str]:
    """``<path>.nf`` of every column-sharded GPT-2 Conv1D: its forward views to that width."""
    params = spec.params if isinstance(spec.params, dict) else {}
    out = []
    for rel, named in params.items():
        path, _, leaf = rel.rpartition(".")
        placement = named.get("tp")
        if leaf != "weight" or not path or not isinstance(placement, Shard) or placement.dim != 1:
            continue
        if is_conv1d(_module(module, path)):
            out.append(f"{path}.nf")
    return out


def input_width(module: nn.Module, spec: ModuleShardingSpec) -> int | None:
    """The hidden width of a region's input: what its column-sharded projections take in."""
    params = spec.params if isinstance(spec.params, dict) else {}
    for rel, named in params.items():
        path, _, leaf = rel.rpartition(".")
        owner, tp = (_module(module, path) if path else None), named.get("tp")
        weight = owner._parameters.get("weight") if owner is not None else None
        if leaf == "weight" and isinstance(tp, Shard) and weight is not None and weight.dim() == 2:
            conv = is_conv1d(owner)  # type: ignore[arg-type]
            if tp.dim == (1 if conv else 0):
                return int(weight.shape[0 if conv else 1])
    return None


def compute_tp_local_attrs(
    model: nn.Module,
    fqn: str,
    spec: ModuleShardingSpec,
    mesh: MeshSpec,
    *,
    attention: bool = False,
) -> dict[str, tuple[int, int]] | None:
    """Head-count attributes (if q/k/v are tp-sharded) and ``tp_divide_attrs`` → (global, local).

    ``attention``: the structure found ``fqn`` to be an attention block, so a tp-sharded
    weight there splits heads whatever its projections are called (``wq``, ``to_q``...).
    """
    tp = mesh.size("tp")
    module = _module(model, fqn)
    names: list[str] = []
    fused_qkv = any(f.get("kind") != "gate_up" for f in spec._fused_layouts.values())
    by_structure = attention and any(
        isinstance(named.get("tp"), Shard) and rel.endswith("weight")
        for rel, named in (spec.params if isinstance(spec.params, dict) else {}).items()
    )
    if _tp_sharded_heads(spec) or fused_qkv or by_structure:
        names += [
            a
            for a in HEAD_COUNT_ATTRS
            if isinstance(getattr(module, a, None), int)
            and not isinstance(getattr(module, a), bool)
        ]
    if fused_qkv:
        names += [a for a in FUSED_QKV_ATTRS if attr_value(module, a) is not None]
    names += _conv1d_widths(module, spec)
    extra = spec.tp_divide_attrs if isinstance(spec.tp_divide_attrs, list) else []
    for attr in extra:
        # The input's width (planner/local_width.py), or a held object's (``config.n_head``).
        if attr == INPUT_WIDTH or "." in attr:
            if attr != INPUT_WIDTH and attr_value(module, attr) is None:
                raise PlanningError(
                    f"{fqn}.tp_divide_attrs: {type(module).__name__}.{attr} is not an integer "
                    "attribute; only integer attributes can be divided by the tp size."
                )
            names += [attr] if attr not in names else []
            continue
        if not hasattr(module, attr):
            public = [
                n for n, v in vars(module).items() if isinstance(v, int) and not n.startswith("_")
            ]
            best = close_matches(attr, public, n=1)
            hint = f" Did you mean {best[0]!r}?" if best else ""
            raise PlanningError(
                f"{fqn}.tp_divide_attrs: {type(module).__name__} has no attribute {attr!r}.{hint} "
                f"Integer attributes there: {public}"
            )
        value = getattr(module, attr)
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanningError(
                f"{fqn}.tp_divide_attrs: {attr!r} is {type(value).__name__} {value!r}; only "
                "integer attributes can be divided by the tp size."
            )
        if attr not in names:
            names.append(attr)
    if not names:
        return None
    plan: dict[str, tuple[int, int]] = {}
    for attr in names:
        value = input_width(module, spec) if attr == INPUT_WIDTH else attr_value(module, attr)
        if value is None:  # pragma: no cover - names holds integer attributes only
            continue
        if value % tp:
            raise DivisibilityError(
                f"{fqn}.{attr} = {value} is not divisible by tp={tp}; each rank must hold an equal "
                f"share. Choose a tp size that divides {value}."
            )
        plan[attr] = (value, value // tp)
    return plan


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's ``transformers.pytorch_utils.Conv1D``: a Linear whose weight is ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)


def compute_deferred_biases(
    model: nn.Module, fqn: str, spec: ModuleShardingSpec
) -> tuple[str, ...]:
    """Biases of rowwise-sharded Linears whose output leaves the boundary as Partial on tp.

    Megatron semantics: such a bias is added once, after the exit reduction, rather than
    on every rank before it (which would count it tp times, or need a division).
    """
    params = spec.params if isinstance(spec.params, dict) else {}
    out_src = spec.out_src if isinstance(spec.out_src, dict) else {}
    if not any(isinstance(layout.get("tp"), Partial) for layout in out_src.values()):
        return ()
    module = _module(model, fqn)
    deferred = []
    for rel, named in params.items():
        if not (rel == "bias" or rel.endswith(".bias")):  # "bias": the boundary is the Linear
            continue
        weight = params.get(rel[: -len("bias")] + "weight", {})
        w_tp, b_tp = weight.get("tp"), named.get("tp", Replicate())
        owner = _module(module, rel.rpartition(".")[0])
        # A Linear's rowwise weight is Shard(1); GPT-2's Conv1D holds it transposed: Shard(0).
        row_dim = 0 if is_conv1d(owner) else 1
        if (isinstance(owner, nn.Linear) or is_conv1d(owner)) and (
            isinstance(w_tp, Shard) and w_tp.dim == row_dim and isinstance(b_tp, Replicate)
        ):
            deferred.append(rel)
    return tuple(deferred)


def lint_plan(
    model: nn.Module,
    modules: Mapping[str, ModuleShardingSpec],
    mesh: MeshSpec,
    roles: Mapping[str, Role] | None = None,
) -> None:
    """Every check that needs the model: axes, parameter shapes, heads, coverage, injections.

    ``roles`` (param FQN → role) is accepted for plugins' callers; fused projections are
    checked where their layouts are derived (``hp_core.planner.fused_layout``).
    """
    for fqn, spec in modules.items():
        if spec.region_dispatch is True and not spec.has_injection:
            raise PlanningError(
                f"{fqn}: region_dispatch=True without an injection is redundant (dispatching is "
                "the default for ordinary boundaries). Remove it, or set region_dispatch: false "
                "if the module's own forward communicates."
            )
        _check_axes(fqn, spec, mesh)
        _check_params(model, fqn, spec, mesh)
        _check_heads(model, fqn, spec, mesh)
        _check_input_names(model, fqn, spec)
    _check_coverage(model, modules, mesh)


def _check_input_names(model: nn.Module, fqn: str, spec: ModuleShardingSpec) -> None:
    """Every declared input must be a parameter of the module's forward.

    A layout for a name the forward does not take is never applied (a silently wrong region).
    """
    if not spec.is_boundary:
        return
    try:
        sig = inspect.signature(_module(model, fqn).forward)
    except (TypeError, ValueError):  # pragma: no cover - nn.Module forwards are introspectable
        return
    params = sig.parameters
    named = [
        n
        for n, p in params.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY)
    ]
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for field in ("in_src", "in_dst"):
        value = getattr(spec, field)
        for name in value if isinstance(value, dict) else {}:
            if name in named or (takes_kwargs and name not in named):
                continue
            best = (close_matches(name, named, n=1) or named or ["x"])[0]
            raise PlanningError(
                f"{fqn}.{field}: the plan gives a layout to input {name!r}, which "
                f"{type(_module(model, fqn)).__name__}.forward{sig} does not take.\nFix: in your "
                f"override for {fqn!r}, name the input as the forward does ({field}: {{{best}: "
                "...}); if no override of yours names it, the template that planned it did "
                "(`hp plugins` shows who provides it)."
            )


def _check_coverage(
    model: nn.Module, modules: Mapping[str, ModuleShardingSpec], mesh: MeshSpec
) -> None:
    if "tp" not in mesh and "cp" not in mesh:
        return  # nothing is planned on any axis: every parameter stays whole
    seen: dict[int, list[tuple[str, Any]]] = {}
    for fqn, spec in modules.items():
        module = _module(model, fqn)
        params = spec.params if isinstance(spec.params, dict) else {}
        for rel, named in params.items():
            sources = spec._ep_stack.get(rel) or [rel]
            for src in sources:
                p = _param(module, src)
                if p is not None:
                    full = f"{fqn}.{src}" if fqn else src
                    seen.setdefault(id(p), []).append((full, dict(named)))
    uncovered = []
    for name, p in model.named_parameters():
        hits = seen.get(id(p), [])
        if not hits:
            if p.requires_grad:
                uncovered.append(name)
            continue
        layouts = {tuple(sorted((a, repr(pl)) for a, pl in named.items())) for _, named in hits}
        if len(layouts) > 1:
            where = ", ".join(f"{n} {_fmt(named)}" for n, named in hits)
            raise CoverageError(
                f"parameter {name} is declared by more than one boundary with different "
                f"placements: {where}. A parameter has one layout; declare it in exactly one "
                "boundary (tied weights must agree)."
            )
        names = [n for n, _ in hits]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise CoverageError(
                f"parameter {dup[0]} is declared more than once (nested boundaries both list it); "
                "every parameter belongs to exactly one boundary. Remove it from all but one."
            )
    if uncovered:
        listing = ", ".join(uncovered[:8]) + (
            f" and {len(uncovered) - 8} more" if len(uncovered) > 8 else ""
        )
        raise CoverageError(
            f"trainable parameter(s) {listing} are not declared by any boundary, so apply would "
            "not know their layout. Add them to the 'params' of the boundary that owns them (an "
            "override with params: {NAME: {tp: replicate}} keeps them whole)."
        )
