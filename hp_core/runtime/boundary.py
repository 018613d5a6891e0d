"""Boundary wrappers: entry redistribution → compute → exit redistribution.

Between boundaries only local tensors flow, each in the layout its contract declares.
A boundary's ``forward`` is replaced by a ``BoundaryForward`` that

* converts each declared input ``in_src → in_dst``,
* runs the computation:
  - validate + dispatching region: the original forward on DTensors (parameters are
    DTensors), then checks each declared output against ``out_src``
    (``PlacementMismatchError``);
  - local region (``region_dispatch=False``, injected compute, or production): local
    tensors; in validate the boundary's own DTensor parameters are unwrapped for the
    call and the outputs re-wrapped by the declared ``out_src``;
* converts each declared output ``out_src → out_dst``, and adds deferred rowwise
  biases once, after the exit reduction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._utils import ExplicitRedistributionContext
from torch.distributed.tensor.experimental import implicit_replication
from torch.utils._python_dispatch import TorchDispatchMode

from hp_core.collectives import grad_is_partial
from hp_core.errors import HpError
from hp_core.mesh import mesh_axes
from hp_core.planner.lints import is_conv1d
from hp_core.planner.local_width import INPUT_WIDTH, present_local
from hp_core.plans.fixes import keep_whole_proposal
from hp_core.plans.proposal import propose
from hp_core.runtime.broadcast import BroadcastToShards
from hp_core.runtime.dtensor_strategies import validate_attention_kernels
from hp_core.runtime.errors import OutputNotATensorError
from hp_core.runtime.fused_views import zero_bias
from hp_core.runtime.layouts import Redistribution, same_placement, to_placements
from hp_core.runtime.partial import contract_partial_axes, is_expert_param
from hp_core.spec.module_spec import ModuleShardingSpec, layout_map
from hp_core.spec.placements import PlacementMismatchError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["BoundaryForward", "UndeclaredCommunicationError", "suspects"]


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class _LegacyEmptyCat(TorchDispatchMode):
    """``torch.cat`` skips 1-D empty tensors (a legacy rule that old KV-cache code relies on);
    DTensor does not, and would re-lay out the empty piece. Drop them before DTensor sees them."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.ops.aten.cat.default and args and isinstance(args[0], list | tuple):
            pieces = [t for t in args[0] if not (t.dim() == 1 and t.numel() == 0)]
            if pieces and len(pieces) < len(args[0]):
                return func(pieces, *args[1:], **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class UndeclaredCommunicationError(HpError, ValueError):
    """Inside a region, DTensor had to redistribute a tensor the contract does not mention."""

    def __init__(
        self,
        fqn: str,
        module_type: str,
        detail: str,
        phase: str = "forward",
        fix: str = "",
        suspects: tuple[str, ...] = (),
    ) -> None:
        self.fqn, self.module_type, self.detail, self.phase, self.fix = (
            fqn,
            module_type,
            detail,
            phase,
            fix,
        )
        self.suspects = tuple(suspects)
        op = detail.replace("Implicit redistribution occurred for ", "").replace(
            " while ExplicitRedistributionContext was active", ""
        )
        op, _, args = op.partition("(")  # the op's arguments, as DTensor shows them, come last
        hint = (
            (
                f" Replicated in this region next to sharded parameters: {', '.join(suspects)} "
                "— the usual culprits."
            )
            if suspects
            else ""
        )
        super().__init__(
            f"{fqn} ({module_type}): in its {phase}, DTensor had to redistribute a tensor inside "
            f"the region: {op}.\nThe contract declares no communication there, and production "
            "(local shards, no DTensor) would compute something else. Usually a parameter's "
            "layout does not fit the activation it meets (a full-width norm on a sharded "
            "projection, a tensor kept whole while heads are split, a projection left replicated "
            f"next to a sharded one).{hint} Declare that parameter's layout, or keep the boundary "
            f"whole on tp (correct, at the cost of replicated compute)."
            + (f"\nDTensor's view of the op: {op}({args}" if args else "")
            + fix
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.fqn, self.module_type, self.detail, self.phase, self.fix, self.suspects),
        )


def suspects(spec: ModuleShardingSpec, axis: str = "tp") -> tuple[str, ...]:
    """A region's parameters replicated on ``axis`` next to sharded ones (not deferred biases)."""
    params = spec.params if isinstance(spec.params, dict) else {}
    if not any(isinstance(n.get(axis), Shard) for n in params.values()):
        return ()
    return tuple(
        rel
        for rel, n in params.items()
        if not isinstance(n.get(axis), Shard)
        and rel not in spec._deferred_bias_params
        and "ep" not in n
    )


def positions(fn: Callable[..., Any]) -> dict[str, int]:
    """Positional index of each parameter of ``fn`` that can be passed positionally."""
    params = inspect.signature(fn).parameters.values()
    return {
        p.name: i
        for i, p in enumerate(params)
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


def _owner(module: nn.Module, rel: str) -> tuple[nn.Module, str]:
    path, _, name = rel.rpartition(".")
    return (module.get_submodule(path) if path else module), name


class BoundaryForward:
    """The replacement ``forward`` of one boundary module."""

    def __init__(
        self,
        fqn: str,
        module: nn.Module,
        spec: ModuleShardingSpec,
        mesh: DeviceMesh,
        mode: str,
        *,
        compute: Callable[..., Any] | None = None,
        dispatch: bool,
        strict: bool = False,
        rng: Any = None,
        fix_match: str | None = None,
        nested: Mapping[str, Mapping[str, Placement]] | None = None,
    ) -> None:
        self.fqn = fqn
        self.module = module
        self.spec = spec
        self.mesh = mesh
        self.mode = mode
        self.original = module.forward
        self.compute = compute if compute is not None else self.original
        self.dispatch = dispatch and mode == "validate"
        self.strict = strict
        self.fix_match = fix_match or fqn  # the override key of the fixes this boundary proposes
        # Randomness inside a region whose computation is sharded on tp draws per rank (rng.py).
        sharded = [
            n
            for n in (*layout_map(spec.params).values(), *layout_map(spec.in_dst).values())
            if isinstance(n.get("tp"), Shard)
        ]
        self.rng = rng if sharded and rng is not None and rng.active else None
        self.__signature__ = inspect.signature(self.original)
        self._pos = positions(self.original)
        # A forward that reads its widths off its (whole) input sees them local, where the
        # planner proved it needs that (planner/local_width.py): (global width, tp).
        width = (spec._tp_local_attr_plan or {}).get(INPUT_WIDTH)
        self.local_width = (width[0], width[0] // width[1]) if width and width[1] else None
        in_src, in_dst = layout_map(spec.in_src), layout_map(spec.in_dst)
        partial_axes = [a for a in mesh_axes(mesh) if grad_is_partial(spec, a)]
        self.inputs = {
            name: Redistribution(
                in_src.get(name, in_dst.get(name)),
                in_dst.get(name, in_src.get(name)),
                mesh,
                grad_partial_axes=partial_axes,
                where=f"{fqn} ({type(module).__name__}) input {name!r}",
            )
            for name in dict.fromkeys([*in_src, *in_dst])
        }
        out_src, out_dst = layout_map(spec.out_src), layout_map(spec.out_dst)
        self.out_names = spec.output_names() or list(out_dst)
        self.outputs = {
            name: Redistribution(
                out_src.get(name, out_dst.get(name)),
                out_dst.get(name, out_src.get(name)),
                mesh,
                where=f"{fqn} ({type(module).__name__}) output {name!r}",
            )
            for name in dict.fromkeys([*out_src, *out_dst])
        }
        self.expected_out = {name: to_placements(layout, mesh) for name, layout in out_src.items()}
        self.deferred = [_owner(module, rel) for rel in spec._deferred_bias_params]
        # The region's parameters: its own and those of parameter-only specs inside it
        # (``nested``, by path from this module), which local code also meets unwrapped.
        own = {r: n for r, n in layout_map(spec.params).items() if r not in spec._ep_stack}
        region = {**own, **(nested or {})}
        self.own_params = [_owner(module, rel) for rel in region]
        # Validate: local code hides from DTensor whether a replicated parameter's gradient is
        # partial, so the contract says it when the parameter is unwrapped for local code.
        names = list(mesh_axes(mesh))
        self.local_grad_placements = {}
        if mode == "validate":
            judged = dataclasses.replace(spec, params={r: dict(n) for r, n in region.items()})
            judged._deferred_bias_params = spec._deferred_bias_params
            for rel in [*spec._deferred_bias_params, *region]:
                named = layout_map(judged.params).get(rel, {})
                if is_expert_param(spec, named):
                    continue
                partial = (
                    contract_partial_axes(fqn, judged, rel, names)
                    if (not self.dispatch or rel in spec._deferred_bias_params)
                    else ()
                )
                base = to_placements(named, mesh)
                self.local_grad_placements[rel] = tuple(
                    Partial() if a in partial else p for a, p in zip(names, base, strict=True)
                )
        self._rel_of = {
            (id(o), n): rel
            for rel, (o, n) in zip(
                [*spec._deferred_bias_params, *region],
                [*self.deferred, *self.own_params],
                strict=True,
            )
        }
        if not (spec.params or self.inputs or self.outputs):
            # An empty contract (e.g. a plan over a dp-only mesh) has nothing to check, and its
            # parameters are plain tensors that a DTensor backward could not mix with.
            self.dispatch = False

    # ------------------------------------------------------------------ inputs
    def _convert_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], how: str
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not self.inputs:
            return args, kwargs
        args = list(args)  # type: ignore[assignment]
        # One tensor given as several inputs (CTRL's v, k, q) is converted once: one
        # collective, and one gradient sum over all its uses.
        done: dict[tuple[int, tuple[Any, ...]], Any] = {}

        def convert(tr: Redistribution, x: Any) -> Any:
            key = (id(x), (tr.src, tr.dst, tr.grad))
            if key not in done:
                done[key] = self._convert(tr, x, how)
            return done[key]

        for name, tr in self.inputs.items():
            if name in kwargs:
                kwargs[name] = convert(tr, kwargs[name])
            else:
                i = self._pos.get(name)
                if i is not None and i < len(args):
                    args[i] = convert(tr, args[i])  # type: ignore[index]
        return tuple(args), kwargs

    @staticmethod
    def _convert(tr: Redistribution, x: Any, how: str) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        if how == "local":
            return tr.local(x)
        if how == "dtensor":
            return tr.to_dtensor(x)
        return tr.via_dtensor(x)

    # ------------------------------------------------------------------ outputs
    def _split(self, out: Any) -> tuple[list[Any], type | None]:
        """The outputs, and the sequence type they came in (None: one output). GPT-1's
        blocks return a list where most return a tuple."""
        if isinstance(out, tuple | list) and len(self.out_names) > 1:
            return list(out), list if isinstance(out, list) else tuple
        return [out], None

    def join(self, items: list[Any], kind: type | None) -> Any:
        return items[0] if kind is None else kind(items)

    def named_outputs(self, out: Any) -> tuple[list[Any], type | None, list[str]]:
        """:meth:`_split`'s items and kind, and the contract's name of each (by position)."""
        items, kind = self._split(out)
        return (
            items,
            kind,
            self.out_names if kind is not None else (self.out_names[:1] or ["output"]),
        )

    def _exit(self, out: Any, how: str) -> Any:
        items, kind, names = self.named_outputs(out)
        for i, name in enumerate(names):
            if i >= len(items) or name not in self.outputs:
                continue
            x, tr = items[i], self.outputs[name]
            if not isinstance(x, torch.Tensor) and not tr.identity:
                # passing it on untouched would skip the declared reduction: silently wrong
                raise OutputNotATensorError(
                    self.fqn, type(self.module).__name__, name, type(x).__name__
                )
            if how == "check":
                items[i] = tr.exit_dtensor(self._check(name, x))
            elif how == "rewrap":
                items[i] = tr.via_dtensor(x)
            else:
                items[i] = tr.local(x)
        if self.deferred and items and isinstance(items[0], torch.Tensor):
            for owner, name in self.deferred:
                bias = owner._parameters[name]
                if isinstance(bias, DTensor):
                    bias = bias.to_local(
                        grad_placements=self.local_grad_placements.get(
                            self._rel_of[(id(owner), name)]
                        )
                    )
                if bias is None:  # _detached_biases has put it back before _exit
                    raise RuntimeError(f"{self.fqn}: deferred bias {name!r} is missing (hp bug).")
                items[0] = items[0] + bias
        return self.join(items, kind)

    def _check(self, name: str, x: Any) -> DTensor:
        expected = self.expected_out.get(name)
        stage = f"out_src[{name}]"
        if not isinstance(x, DTensor):
            raise PlacementMismatchError(
                self.fqn,
                layout_map(self.spec.out_src)[name],
                f"a plain {type(x).__name__} (not a DTensor)",
                stage,
            )
        if expected is not None and not all(
            same_placement(a, e) for a, e in zip(x.placements, expected, strict=True)
        ):
            names = list(mesh_axes(self.mesh))
            actual = dict(zip(names, x.placements, strict=True))
            declared = dict(zip(names, expected, strict=True))
            raise PlacementMismatchError(self.fqn, declared, actual, stage)
        return x

    # ------------------------------------------------------------------ call
    @contextlib.contextmanager
    def _detached_biases(self) -> Iterator[None]:
        saved = [(o, n, o._parameters[n]) for o, n in self.deferred]
        for o, n, p in saved:
            # GPT-2's Conv1D always adds its bias (addmm): it gets zeros of the partial sum.
            zeros = zero_bias(p, self.mesh, self.dispatch) if is_conv1d(o) else None
            o._parameters[n] = zeros  # type: ignore[assignment]  # a stand-in for the call
        try:
            yield
        finally:
            for o, n, p in saved:
                o._parameters[n] = p

    @contextlib.contextmanager
    def _local_params(self) -> Iterator[None]:
        """Validate, local region: the boundary's own DTensor parameters as local tensors."""
        saved: list[tuple[nn.Module, str, nn.Parameter]] = []
        for owner, name in self.own_params:
            p = owner._parameters.get(name)
            if isinstance(p, DTensor):
                saved.append((owner, name, p))
                rel = self._rel_of[(id(owner), name)]
                owner._parameters[name] = p.to_local(
                    grad_placements=self.local_grad_placements.get(rel)
                )
        try:
            yield
        finally:
            for owner, name, p in saved:
                owner._parameters[name] = p

    @contextlib.contextmanager
    def declared_only(self, phase: str = "forward") -> Iterator[None]:
        """Validate: inside a region, DTensor may not redistribute anything on its own.

        An implicit redistribution is communication (or a silent re-slicing) that the
        contract does not declare, and production — which runs the same code on local
        shards — would not do it: the two modes would differ.
        """
        if not self.strict:
            with BroadcastToShards():
                yield
            return
        try:
            with ExplicitRedistributionContext(strict=True), BroadcastToShards():
                yield
        except RuntimeError as e:
            if "Implicit redistribution" not in str(e):
                raise
            who = (self.fqn, type(self.module).__name__, str(e))
            error = UndeclaredCommunicationError(*who, phase=phase, suspects=suspects(self.spec))
            fix = keep_whole_proposal(self.fqn, self.spec, match=self.fix_match)
            raise propose(error, fix) from None

    def _replicate_rest(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Validate: undeclared tensor inputs (rotary tables, masks) join as replicated DTensors.

        Wrapping them explicitly (rather than only allowing implicit replication) keeps the
        tensors autograd saves for backward DTensors too.
        """
        placements = [Replicate()] * self.mesh.ndim

        def wrap(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                return DTensor.from_local(x, self.mesh, placements, run_check=False)
            if isinstance(x, tuple | list) and any(isinstance(v, torch.Tensor) for v in x):
                return type(x)(wrap(v) for v in x)
            return x

        return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}

    def _local_width(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The region's hidden-width plain-tensor inputs shown local to its forward."""
        w = self.local_width
        return (args, kwargs) if w is None else present_local(args, kwargs, w[0], w[1])

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """Validate: a plain tensor the region's backward will need, as the replicated DTensor
        that ``implicit_replication`` made of it in forward (backward runs outside that mode)."""
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
            return DTensor.from_local(t, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        return t

    def _random(self) -> Any:
        return (
            self.rng.sharded_region(self.fqn) if self.rng is not None else contextlib.nullcontext()
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.mode == "production":
            args, kwargs = self._local_width(*self._convert_inputs(args, kwargs, "local"))
            with self._detached_biases(), self._random():
                out = self.compute(*args, **kwargs)
            return self._exit(out, "local")
        if self.dispatch:
            args, kwargs = self._replicate_rest(*self._convert_inputs(args, kwargs, "dtensor"))
            with (
                self._detached_biases(),
                implicit_replication(),
                validate_attention_kernels(self.mesh),
                self.declared_only(),
                _LegacyEmptyCat(),
                self._random(),
                torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack),
            ):
                out = self.compute(*args, **kwargs)
            return self._exit(out, "check")
        args, kwargs = self._local_width(*self._convert_inputs(args, kwargs, "via"))
        with self._detached_biases(), self._local_params(), self._random():
            out = self.compute(*args, **kwargs)
        return self._exit(out, "rewrap")
