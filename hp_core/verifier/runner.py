"""``verify(model, plan, mesh)``: prove a plan on meta-device copies before anything runs.

Two copies of the model, with meta tensors for weights, run one forward (and backward):

1. **validate copy** — the plan installed in validate mode: parameters are DTensors and
   every dispatching region runs the module's own forward on DTensors. The region may not
   redistribute anything on its own (that is communication the contract does not declare,
   or a parameter that does not fit its activation), its outputs must have the declared
   ``out_src``, random ops may not touch partial sums, and its backward — run per region,
   in isolation — may not redistribute either. That backward also says, per parameter and
   axis, whether this rank's gradient is whole or partial.
2. **production copy** — the plan installed in production mode: local shards and hp's
   own collectives (shape-only on meta). Production's code must run, and every boundary
   must produce the same local shapes as in validate mode.

Where DTensor cannot look (code that runs on local tensors: ``region_dispatch=False``,
injected compute, a deferred bias) the gradient rule is the contract's
(``hp_core.runtime.partial``). Injected compute is replaced by the module's own forward
(an injection promises the same math); compute that cannot run on meta (data-dependent
routing) is reported as not looked into.

No collective runs: on a real mesh, DTensor and hp's collectives only compute shapes for
meta tensors; without one, a fake process group of the plan's size is used, so a plan for
1,024 ranks is verified on a laptop. Repeated layers are checked once.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from hp_core.mesh import MeshSpec
from hp_core.planner.comms import grad_is_partial
from hp_core.runtime.grads import GradReduction
from hp_core.runtime.install import install
from hp_core.runtime.journal import Journal
from hp_core.runtime.partial import (
    AmbiguousGradientError,
    activations_on,
    contract_partial_axes,
    is_data_axis,
)
from hp_core.runtime.preflight import InjectionPlan, PreflightResult, check_locally
from hp_core.sharding_plan import ShardingPlan
from hp_core.verifier.errors import (
    InputGradientError,
    LayoutMismatchError,
    MixedGradientError,
    ProductionDiffersError,
    UnverifiableError,
    VerificationError,
)
from hp_core.verifier.meta import MetaValues, adapt_for_meta, meta_clone
from hp_core.verifier.probes import (
    BoundaryRecord,
    ProductionProbe,
    Repeater,
    ShapeRecorder,
    ValidateProbe,
    opaque_fallback,
    tensors_in,
)
from hp_core.verifier.repeats import find_repeats

__all__ = ["VerifyReport", "verify"]


@dataclasses.dataclass
class VerifyReport:
    """What the verifier proved about one plan on one mesh."""

    fingerprint: str
    mesh: tuple[tuple[str, int], ...]
    #: the gradients that are partial sums, and over which axes hp sums them
    reductions: tuple[GradReduction, ...]
    #: boundaries whose region DTensor propagation checked
    checked: tuple[str, ...]
    #: boundaries whose inside runs on local tensors: not looked into, and why
    opaque: dict[str, str]
    #: repeated layer → the identical one that was checked in its place
    repeated: dict[str, str]
    seconds: float = 0.0

    def partial(self) -> dict[str, tuple[str, ...]]:
        """``{parameter FQN: axes}`` of every partial gradient."""
        return {r.param: r.axes for r in self.reductions}

    def summary(self) -> str:
        lines = [
            f"verified on mesh {dict(self.mesh)} in {self.seconds:.2f} s: {len(self.checked)} boundaries checked by "
            f"propagation, {len(self.opaque)} run on local tensors, {len(self.repeated)} repeated layers skipped",
        ]
        by_axes: dict[tuple[str, ...], list[str]] = {}
        for r in self.reductions:
            by_axes.setdefault(r.axes, []).append(r.param)
        for axes, names in by_axes.items():
            lines.append(f"  partial gradients summed over {'+'.join(axes)}: {len(names)} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
        for fqn, why in list(self.opaque.items())[:8]:
            lines.append(f"  not looked into: {fqn} ({why})")
        return "\n".join(lines)


# ---------------------------------------------------------------------- mesh


@contextlib.contextmanager
def _verification_mesh(plan: ShardingPlan, mesh: Any) -> Iterator[Any]:
    """A DeviceMesh to verify on: the given one, or one over a fake process group."""
    if mesh is not None and hasattr(mesh, "get_group"):
        yield mesh
        return
    spec = MeshSpec.from_any(mesh) if mesh is not None else None
    if spec is None:
        if plan.mesh_shape is None:
            raise UnverifiableError(
                "verify(): the plan knows only its axis names; pass the mesh sizes, e.g. verify(model, plan, 'tp=8')."
            )
        spec = MeshSpec(plan.mesh_axis_names, plan.mesh_shape)
    if dist.is_available() and dist.is_initialized():
        raise UnverifiableError(
            f"verify(): a process group is already initialized, so hp cannot start a fake one for {spec}; pass "
            "the DeviceMesh the plan will run on (verification on it communicates nothing)."
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(spec.sizes))
    try:
        yield init_device_mesh("cpu", spec.sizes, mesh_dim_names=spec.axis_names)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- inputs


def _sequence_length(mesh: Any) -> tuple[int, int]:
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))
    tp, cp = sizes.get("tp", 1), sizes.get("cp", 1)
    return 4 * tp * cp * 2, cp  # a multiple of tp, cp and 2*cp (load-balanced CP)


def _default_inputs(model: nn.Module, mesh: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    total, cp = _sequence_length(mesh)
    ids = torch.empty((2, total // cp), dtype=torch.long, device="meta")  # this rank's share of the sequence
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - nn.Module forwards are introspectable
        params = {}
    if "input_ids" in params:
        kwargs: dict[str, Any] = {"input_ids": ids}
        if "labels" in params:
            kwargs["labels"] = ids
        if "use_cache" in params:
            kwargs["use_cache"] = False
        return (), kwargs
    if any(isinstance(m, nn.Embedding) for m in model.modules()):
        return (ids,), {}
    raise UnverifiableError(
        f"verify(): hp cannot guess what {type(model).__name__}.forward takes; pass one rank's inputs, e.g. "
        "report = hp_core.verify(model, plan, mesh, inputs=((x,), {})), then apply(..., verify=report)."
    )


def _to_meta_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.empty(v.shape, dtype=v.dtype, device="meta")
        if isinstance(v, dict):
            return {k: conv(i) for k, i in v.items()}
        if isinstance(v, list | tuple):
            return type(v)(conv(i) for i in v)
        return v

    if isinstance(inputs, dict):
        return (), conv(inputs)
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict) and isinstance(inputs[0], tuple | list):
        return tuple(conv(inputs[0])), conv(inputs[1])
    if isinstance(inputs, tuple | list):
        return tuple(conv(inputs)), {}
    return (conv(inputs),), {}


# ---------------------------------------------------------------------- passes


def _verifier_pre(pre: PreflightResult, plan: ShardingPlan) -> PreflightResult:
    """Injections for the meta copies: pure-op ones stay, the rest give way to the module's own forward."""
    injections = {}
    for fqn, inj in pre.injections.items():
        keep = plan[fqn].region_dispatch is True
        injections[fqn] = inj if keep else InjectionPlan()
    return PreflightResult(injections, dict(pre.meshes))


def _prefixes(fqn: str) -> list[str]:
    """``"a.b.c"`` → ``["a", "a.b", "a.b.c"]``."""
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _under(fqn: str, roots: Mapping[str, Any]) -> str | None:
    """The root of ``roots`` that ``fqn`` is (or lies under), if any (a dict lookup per prefix)."""
    return next((p for p in _prefixes(fqn) if p in roots), None)


def _reduced_plan(plan: ShardingPlan, repeats: Mapping[str, str]) -> ShardingPlan:
    modules = {f: copy.copy(s) for f, s in plan.items() if _under(f, repeats) is None}
    return dataclasses.replace(plan, modules=modules, notes=[])


def _run(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], backward: bool) -> None:
    out = model(*args, **kwargs)
    if not backward:
        return
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
        return
    outs = [t for t in tensors_in(out) if t.requires_grad and t.is_floating_point()]
    if outs:
        torch.autograd.backward(outs, [torch.zeros_like(t) for t in outs])


def _region_params(model: nn.Module, plan: ShardingPlan, fqn: str) -> dict[str, Any]:
    """Parameters a boundary's region computes with: its own and those of non-boundary specs inside it."""
    boundaries = [f for f, s in plan.items() if s.is_boundary and f != fqn and (not fqn or f.startswith(fqn + "."))]
    out: dict[str, Any] = {}
    for f, spec in plan.items():
        inside = f == fqn or not fqn or f.startswith(fqn + ".")
        if not inside or (f != fqn and spec.is_boundary) or any(f == b or f.startswith(b + ".") for b in boundaries):
            continue
        for rel, named in (spec.params or {}).items():
            if "ep" in named and spec._ep_size > 1:
                continue
            name = f"{f}.{rel}" if f else rel
            path, _, attr = name.rpartition(".")
            owner = model.get_submodule(path) if path else model
            p = owner._parameters.get(attr)
            if p is not None:
                out[name] = p
    return out


def _install_copy(model: nn.Module, plan: ShardingPlan, mesh: Any, mode: str, pre: PreflightResult, repeats: Mapping[str, str]) -> tuple[nn.Module, ShardingPlan, Any]:
    clone = meta_clone(model, repeats)
    adapt_for_meta(clone)
    clone.train()  # dropouts active: a random op on a partial sum must be seen
    reduced = _reduced_plan(plan, repeats)
    state = install(clone, reduced, mesh, mode, pre, Journal(), reduce=False, check_inputs=False, streams=False)
    return clone, reduced, state


def _wrap_repeaters(clone: nn.Module, repeats: Mapping[str, str]) -> list[Repeater]:
    out = []
    for rep in dict.fromkeys(repeats.values()):
        module = clone.get_submodule(rep)
        r = Repeater(module.forward)
        module.__dict__["forward"] = r
        out.append(r)
    return out


def _plain_pass(model: nn.Module, plan: ShardingPlan, repeats: Mapping[str, str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, BoundaryRecord]:
    """The unsharded model on meta: the global shape of every boundary's inputs and outputs."""
    clone = meta_clone(model, repeats)
    adapt_for_meta(clone)
    clone.train()
    reduced = _reduced_plan(plan, repeats)
    records: dict[str, BoundaryRecord] = {}
    for fqn, spec in reduced.items():
        if spec.is_boundary:
            module = clone.get_submodule(fqn) if fqn else clone
            records[fqn] = BoundaryRecord(fqn, False)
            module.__dict__["forward"] = ShapeRecorder(module.forward, records[fqn], spec)
    _wrap_repeaters(clone, repeats)
    _run(clone, args, kwargs, backward=False)
    return records


def _whole_inputs(args: tuple[Any, ...], kwargs: dict[str, Any], plan: ShardingPlan, mesh: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The unsharded model's inputs: a rank's inputs are its chunk of the sequence (dim 1)
    along every axis that shards activations everywhere (context parallelism)."""
    sizes = dict(zip(mesh.mesh_dim_names, (int(n) for n in mesh.shape), strict=True))
    k = math.prod(n for a, n in sizes.items() if n > 1 and not is_data_axis(a) and activations_on(plan.modules, a) == "sharded")
    if k == 1:
        return args, kwargs

    def grow(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() >= 2:
            shape = list(v.shape)
            shape[1] *= k
            return torch.empty(shape, dtype=v.dtype, device="meta")
        return v

    return tuple(grow(a) for a in args), {key: grow(v) for key, v in kwargs.items()}


def _local_shape(shape: tuple[int, ...], layout: Mapping[str, Any], sizes: Mapping[str, int]) -> tuple[int, ...] | None:
    """The local shape of a tensor of global ``shape`` in ``layout`` (None if a split does not divide)."""
    out = list(shape)
    for axis, p in layout.items():
        n = sizes.get(str(axis), 1)
        if isinstance(p, Shard) and n > 1:
            if p.dim >= len(out) or out[p.dim] % n:
                return None
            out[p.dim] //= n
    return tuple(out)


def _check_layouts(plain: Mapping[str, BoundaryRecord], prod: Mapping[str, BoundaryRecord], plan: ShardingPlan, sizes: Mapping[str, int]) -> None:
    """What arrives at and leaves each boundary has the local shape its declared layouts give
    the unsharded model's tensors: a boundary that declares a layout its producer does not
    give (an input said to be sharded that arrives whole, or the reverse) is refused."""
    for fqn, rec in prod.items():
        ref = plain.get(fqn)
        if ref is None or len(ref.inputs) != len(rec.inputs) or ref.skipped or rec.skipped:
            continue
        spec = plan[fqn]
        for call, (glob_in, loc_in) in enumerate(zip(ref.inputs, rec.inputs, strict=True)):
            for name, shape in glob_in.items():
                layout = (spec.in_src or {}).get(name) or (spec.in_dst or {}).get(name) or {}
                want, got = _local_shape(shape, layout, sizes), loc_in.get(name)
                if got is not None and want != got:
                    raise LayoutMismatchError(
                        f"{fqn}: its input {name!r} arrives with local shape {got} on each rank, but its in_src "
                        f"{_fmt(layout)} makes the unsharded model's {shape} into {want}. What arrives is in "
                        "another layout than the contract declares: the boundary before it (or the model's code "
                        "between them) produces something else. Declare the layout that arrives, or make the "
                        "producer's out_dst give the declared one."
                    )
            outs = spec.output_names() or list(spec.out_dst or {})
            if outs and ref.shapes[call] and rec.shapes[call]:
                layout = (spec.out_dst or {}).get(outs[0]) or (spec.out_src or {}).get(outs[0]) or {}
                want, got = _local_shape(ref.shapes[call][0], layout, sizes), rec.shapes[call][0]
                if want != got:
                    raise LayoutMismatchError(
                        f"{fqn}: its output {outs[0]!r} leaves with local shape {got} on each rank, but its out_dst "
                        f"{_fmt(layout)} makes the unsharded model's {ref.shapes[call][0]} into {want}."
                    )


def _fmt(layout: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{a}: {p}" for a, p in layout.items()) + "}"


def _validate_pass(model, plan, mesh, pre, repeats, args, kwargs) -> tuple[dict[str, BoundaryRecord], ShardingPlan]:
    clone, reduced, state = _install_copy(model, plan, mesh, "validate", pre, repeats)
    records: dict[str, BoundaryRecord] = {}
    for fqn, bf in state.forwards.items():
        rec = records[fqn] = BoundaryRecord(fqn, bf.dispatch)
        if not bf.dispatch:
            opaque_fallback(bf, rec)
        params = _region_params(clone, reduced, fqn) if bf.dispatch else {}
        bf.module.__dict__["forward"] = ValidateProbe(bf, rec, params)
    _wrap_repeaters(clone, repeats)
    _run(clone, args, kwargs, backward=False)
    return records, reduced


def _production_pass(model, plan, mesh, pre, repeats, args, kwargs, val_records) -> dict[str, BoundaryRecord]:
    clone, reduced, state = _install_copy(model, plan, mesh, "production", pre, repeats)
    records: dict[str, BoundaryRecord] = {}
    for fqn, bf in state.forwards.items():
        rec = records[fqn] = BoundaryRecord(fqn, False)
        if not val_records[fqn].dispatching:
            opaque_fallback(bf, rec)
        bf.module.__dict__["forward"] = ProductionProbe(bf, rec, fqn, reduced[fqn])
    _wrap_repeaters(clone, repeats)
    try:
        _run(clone, args, kwargs, backward=True)
    except VerificationError:
        raise
    except Exception as e:
        raise ProductionDiffersError(
            f"production mode fails outside every boundary, in the model's own code: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}. The layouts between boundaries are not what that code "
            "expects (e.g. a sequence-sharded activation where it needs the whole sequence)."
        ) from e
    return records


# ---------------------------------------------------------------------- gradients


def _partial_axes(named: tuple[tuple[str, Any], ...], names: list[str]) -> tuple[str, ...]:
    by_axis = dict(named)
    return tuple(a for a in names if isinstance(by_axis.get(a), Partial) and not is_data_axis(a))


def _check_inputs(records: Mapping[str, BoundaryRecord], plan: ShardingPlan, names: list[str]) -> None:
    """Production's entry transitions assume an input gradient partial exactly where the
    boundary shards parameters; DTensor's backward must agree, or the two modes differ."""
    for fqn, rec in records.items():
        spec = plan[fqn]
        for name, seen in rec.input_grads.items():
            dst = (spec.in_dst or {}).get(name) or (spec.in_src or {}).get(name) or {}
            for named in seen:
                for axis, p in named:
                    if is_data_axis(axis) or not isinstance(dst.get(axis, Replicate()), Replicate):
                        continue
                    expected = grad_is_partial(spec, axis)
                    if isinstance(p, Partial) != expected:
                        raise InputGradientError(
                            f"{fqn}: the gradient of its input {name!r} is {'partial' if isinstance(p, Partial) else 'whole'} "
                            f"on {axis!r} in DTensor's backward, but production's entry transition assumes it "
                            f"{'partial' if expected else 'whole'} (it {'sums' if expected else 'does not sum'} it over "
                            f"{axis}). The region mixes sharded and replicated paths from this input; shard the "
                            "replicated ones, or keep the boundary whole on that axis."
                        )


def _enclosing_boundary(plan: ShardingPlan, fqn: str) -> str | None:
    """The innermost boundary strictly enclosing ``fqn`` (the root module counts)."""
    for p in reversed(["", *_prefixes(fqn)[:-1]]):
        spec = plan.modules.get(p)
        if spec is not None and spec.is_boundary:
            return p
    return None


def _outside(plan: ShardingPlan, fqn: str, name: str, named: Mapping[str, Any], names: list[str]) -> tuple[str, ...]:
    """Partial axes of a parameter whose module runs outside every boundary."""
    axes = []
    for axis in names:
        if is_data_axis(axis) or not isinstance(named.get(axis, Replicate()), Replicate):
            continue
        how = activations_on(plan.modules, axis)
        if how == "mixed":
            raise AmbiguousGradientError(
                f"{name}: its module runs outside every boundary, where activations are sharded on "
                f"{axis!r} in some places and whole in others, so hp cannot tell which tokens it sees. "
                f"Make {fqn or 'it'} a boundary that declares its input layout, e.g.:\n"
                f"  - match: {fqn!r}\n    in_src: {{input: {{{axis}: replicate}}}}\n"
                f"    out_src: {{output: {{{axis}: replicate}}}}\n    out_dst: {{output: {{{axis}: replicate}}}}"
            )
        if how == "sharded":
            axes.append(axis)
    return tuple(axes)


def _region_layouts(plan: ShardingPlan) -> dict[str, dict[str, Mapping[str, Any]]]:
    """Per boundary: every parameter layout its region computes with, by path relative to it."""
    out: dict[str, dict[str, Mapping[str, Any]]] = {}
    for f, s in plan.items():
        covered = f if s.is_boundary else _enclosing_boundary(plan, f)
        if covered is None:
            continue
        for rel, named in (s.params or {}).items():
            full = f"{f}.{rel}" if f else rel
            out.setdefault(covered, {})[full[len(covered) + 1 :] if covered else full] = named
    return out


def _derive(
    model: nn.Module,
    plan: ShardingPlan,
    names: list[str],
    records: Mapping[str, BoundaryRecord],
    repeats: Mapping[str, str],
) -> tuple[tuple[GradReduction, ...], dict[str, str]]:
    """Every parameter's partial axes: propagation where it ran, the contract elsewhere.

    Names are the plan's; a repeated layer takes the answer of the layer checked in its place.
    """
    opaque: dict[str, str] = {}
    found: dict[str, list[tuple[tuple[str, ...], str]]] = {}  # parameter FQN → [(axes, source)]
    layouts = _region_layouts(plan)
    for fqn, spec in plan.items():
        covered = fqn if spec.is_boundary else _enclosing_boundary(plan, fqn)
        for rel, named in (spec.params or {}).items():
            if "ep" in named and spec._ep_size > 1:
                continue  # experts: their replicas are summed by the expert layout
            name = f"{fqn}.{rel}" if fqn else rel
            if covered is None:
                found.setdefault(name, []).append((_outside(plan, fqn, name, named, names), "contract"))
                continue
            rec = records.get(_map_to_rep(covered, repeats))
            grads = None if rec is None else rec.grads.get(_map_to_rep(name, repeats))
            deferred = spec.is_boundary and rel in spec._deferred_bias_params
            if rec is not None and rec.dispatching and grads and not deferred:
                for placements in grads:
                    found.setdefault(name, []).append((_partial_axes(placements, names), "propagation"))
                continue
            if rec is not None and not rec.dispatching:
                opaque.setdefault(covered, rec.skipped or "its compute runs on local tensors (region_dispatch=False or injected)")
            region = plan[covered]
            rel_in_region = name[len(covered) + 1 :] if covered else name
            if fqn != covered:  # a non-boundary spec inside the region: judge it by the region's contract
                region = dataclasses.replace(region, params={**(region.params or {}), rel_in_region: named})
                region._deferred_bias_params = plan[covered]._deferred_bias_params
            axes = contract_partial_axes(covered, region, rel_in_region, names, region_params=layouts.get(covered, {}))
            found.setdefault(name, []).append((axes, "contract"))
    return _per_parameter(model, found), opaque


def _per_parameter(model: nn.Module, found: Mapping[str, list[tuple[tuple[str, ...], str]]]) -> tuple[GradReduction, ...]:
    """One reduction per parameter object; tied names (and every use) must agree."""
    by_object: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_object.setdefault(id(p), []).append(n)
    reductions: list[GradReduction] = []
    for aliases in by_object.values():
        uses = [c for n in aliases for c in found.get(n, ())]
        kinds = {axes for axes, _ in uses}
        if len(kinds) > 1:
            most, least = max(kinds, key=len), min(kinds, key=len)
            raise MixedGradientError(
                f"{aliases[0]}: its gradient is partial over {list(most)} in one use and over "
                f"{list(least) or 'nothing'} in another (names {aliases}); no single reduction makes both "
                "right. Give its uses the same layout, or untie the weights."
            )
        if kinds and (axes := next(iter(kinds))):
            source = "propagation" if any(s == "propagation" for _, s in uses) else "contract"
            reductions.append(GradReduction(aliases[0], axes, source))
    return tuple(reductions)


def _map_to_rep(fqn: str, repeats: Mapping[str, str]) -> str:
    root = _under(fqn, repeats)
    return fqn if root is None else repeats[root] + fqn[len(root):]


# ---------------------------------------------------------------------- entry point


def verify(
    model: nn.Module,
    plan: ShardingPlan,
    mesh: Any = None,
    *,
    inputs: Any = None,
    exhaustive: bool = False,
    preflight: PreflightResult | None = None,
) -> VerifyReport:
    """Prove ``plan`` right for ``model`` on meta-device copies; raise what cannot be proven.

    ``mesh``: the DeviceMesh the plan will run on (nothing is communicated), or a mesh
    description (``"tp=8"``) or None to verify on a fake process group of the plan's size.
    ``inputs``: one rank's model inputs (tensors are only read for shapes and dtypes);
    default: token ids for a causal LM. ``exhaustive`` checks repeated layers too. The
    model is not touched. Raises a :class:`~hp_core.VerificationError` (or the
    preflight error) naming the module, the parameter and the fix.
    """
    t0 = time.perf_counter()
    with _verification_mesh(plan, mesh) as dmesh:
        pre = preflight if preflight is not None else check_locally(model, plan, dmesh, "validate")
        vpre = _verifier_pre(pre, plan)
        repeats = {} if exhaustive else find_repeats(model, plan.modules)
        args, kwargs = _default_inputs(model, dmesh) if inputs is None else _to_meta_inputs(inputs)
        names = list(dmesh.mesh_dim_names)
        try:
            with MetaValues(), torch.enable_grad():
                val, reduced = _validate_pass(model, plan, dmesh, vpre, repeats, args, kwargs)
                prod = _production_pass(model, plan, dmesh, vpre, repeats, args, kwargs, val)
                try:
                    plain: dict[str, BoundaryRecord] | None = _plain_pass(model, plan, repeats, *_whole_inputs(args, kwargs, plan, dmesh))
                except Exception:  # the unsharded model's own code does not run on meta: no layout check
                    plain = None
        except (VerificationError, AmbiguousGradientError):
            raise
        except Exception as e:
            from hp_core.errors import HpError

            if isinstance(e, HpError):
                raise
            raise UnverifiableError(
                f"verify(): running {type(model).__name__} on meta tensors failed outside what hp can attribute: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ) from e
        for fqn, rec in val.items():
            other = prod.get(fqn)
            if other is not None and rec.shapes != other.shapes:
                raise ProductionDiffersError(
                    f"{fqn}: production mode produces local output shapes {other.shapes} where validate mode "
                    f"produces {rec.shapes}: the module reads a size from its attributes or its inputs that the "
                    "plan shards (declare it in tp_divide_attrs), or an output's declared layout is wrong."
                )
        if plain is not None:
            _check_layouts(plain, prod, reduced, dict(zip(names, (int(n) for n in dmesh.shape), strict=True)))
        _check_inputs(val, reduced, names)
        reductions, opaque = _derive(model, plan, names, val, repeats)
    return VerifyReport(
        fingerprint=plan.fingerprint(),
        mesh=tuple(zip(names, (int(s) for s in dmesh.shape), strict=True)),
        reductions=reductions,
        checked=tuple(f for f, r in val.items() if r.dispatching),
        opaque=opaque,
        repeated=dict(repeats),
        seconds=time.perf_counter() - t0,
    )
