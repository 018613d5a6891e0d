"""The instruments the verifier puts around each boundary of its meta-device copies.

* :class:`ValidateProbe` (validate copy): after the boundary's forward on DTensors, runs
  the boundary's own backward in isolation (from its outputs to its inputs and
  parameters) with implicit redistribution forbidden, and records the placements of the
  parameters' and inputs' gradients. Around the region's compute it refuses random ops
  on partial values.
* :class:`ProductionProbe` (production copy): names the boundary in which production's
  code fails on local shards.
* :class:`Repeater`: an element of a layer stack that repeats one already checked with
  the same inputs returns its input (see ``hp_core.verifier.repeats``).

All of them record, per boundary and call, the local shapes of the outputs, which the
verifier compares between the two modes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial
from torch.utils._python_dispatch import TorchDispatchMode

from hp_core.collectives import grad_is_partial
from hp_core.errors import HpError
from hp_core.mesh import mesh_axes
from hp_core.plans.fixes import keep_whole_proposal
from hp_core.plans.proposal import propose
from hp_core.runtime.boundary import BoundaryForward, positions
from hp_core.runtime.nested import tensors_in
from hp_core.spec.module_spec import layout_map
from hp_core.verifier.errors import ProductionDiffersError, RandomOnPartialError, VerificationError

__all__ = [
    "BoundaryRecord",
    "ProductionProbe",
    "Repeater",
    "ShapeRecorder",
    "ValidateProbe",
    "call_key",
    "declared_shapes",
    "opaque_fallback",
]

#: How a report's ``opaque`` entry begins for a region whose code never ran (nothing in it,
#: nor in what it feeds, was checked).
NOT_RUN = "its code does not run on meta tensors"


def call_key(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What a module's behaviour in a call can depend on: tensor shapes, dtypes, layouts, values."""

    def key(v: Any) -> Any:
        if isinstance(v, DTensor):
            return ("D", tuple(v.shape), str(v.dtype), tuple(v.placements), v.requires_grad)
        if isinstance(v, torch.Tensor):
            return ("T", tuple(v.shape), str(v.dtype), v.requires_grad)
        if isinstance(v, list | tuple):
            return tuple(key(i) for i in v)
        if isinstance(v, dict):
            return tuple(sorted((str(k), key(i)) for k, i in v.items()))
        if isinstance(v, int | float | bool | str | type(None)):
            return repr(v)
        return type(v).__qualname__

    return (tuple(key(a) for a in args), key(kwargs))


def _named(t: Any) -> tuple[tuple[str, Any], ...]:
    """A DTensor's placements by mesh axis name (empty for a plain tensor)."""
    if not isinstance(t, DTensor):
        return ()
    return tuple(zip(t.device_mesh.mesh_dim_names or (), t.placements, strict=True))


def _leaves(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
        return x.detach().requires_grad_(True) if x.requires_grad else x
    if isinstance(x, dict):
        return {k: _leaves(v) for k, v in x.items()}
    if isinstance(x, list | tuple) and type(x) in (list, tuple):
        return type(x)(_leaves(v) for v in x)
    return x


def _local_shapes(out: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(
        tuple((t._local_tensor if isinstance(t, DTensor) else t).shape) for t in tensors_in(out)
    )


def _named_args(
    bf: BoundaryForward, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[str, Any]]:
    """A call's arguments by the forward's parameter names (``argument 3`` past them)."""
    names = {i: n for n, i in bf._pos.items()}
    return [(names.get(i, f"argument {i}"), a) for i, a in enumerate(args)] + list(kwargs.items())


@dataclasses.dataclass
class BoundaryRecord:
    """What one boundary did in one verification pass."""

    fqn: str
    dispatching: bool
    #: local output shapes, per distinct call
    shapes: list[tuple[tuple[int, ...], ...]] = dataclasses.field(default_factory=list)
    #: parameter FQN → ((axis, placement), ...) of each gradient contribution seen
    grads: dict[str, list[tuple[Any, ...]]] = dataclasses.field(default_factory=dict)
    #: declared input name → ((axis, placement), ...) of its DTensor gradient
    input_grads: dict[str, list[tuple[Any, ...]]] = dataclasses.field(default_factory=dict)
    #: the same, for tensor inputs the contract does not declare (a mask, a rotary table
    #: that carries a gradient, CTRL's k and q): production hands their gradient back as is
    undeclared_grads: dict[str, list[tuple[Any, ...]]] = dataclasses.field(default_factory=dict)
    #: undeclared outputs a gradient flowed back into from the model's code (production)
    escaped: set[str] = dataclasses.field(default_factory=set)
    #: why the region's own code could not run on meta (a local region only)
    skipped: str | None = None
    #: declared input name → local shape, per distinct call
    inputs: list[dict[str, tuple[int, ...]]] = dataclasses.field(default_factory=list)


def opaque_fallback(
    bf: BoundaryForward, record: BoundaryRecord, plain: BoundaryRecord | None, mode: str
) -> None:
    """A local region whose code cannot run on meta tensors passes its first input through.

    Such code is opaque to DTensor anyway (its gradients follow the contract); what the
    verifier still needs from it is an output of the right shape for what comes after. Only
    a meta-device limitation earns the pass: when the unsharded model ran the same region's
    code on meta (``plain``, the unsharded pass's record of it), a failure on the planned
    layouts is the plan's, and is refused.
    """
    compute = bf.compute
    n_out = max(1, len(bf.out_names))
    ran_whole = plain is not None and plain.skipped is None and bool(plain.shapes)

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return compute(*args, **kwargs)
        except HpError:
            raise  # a finding inside (a nested boundary's), not a meta limitation
        except Exception as e:
            x = next((t for t in tensors_in((args, kwargs)) if t.is_floating_point()), None)
            first = str(e).splitlines()[0][:200] if str(e) else ""
            if ran_whole:
                raise propose(
                    ProductionDiffersError(
                        f"{bf.fqn} ({type(bf.module).__name__}): in {mode} mode this region's "
                        f"code fails on this rank's local shards ({type(e).__name__}: {first}), "
                        "while the unsharded model runs the same code on meta tensors: not a "
                        "meta-device limitation, the layouts the plan gives it do not fit its "
                        "code (e.g. a table of the whole sequence meeting a sequence shard, or a "
                        "head count not made local). Handing the region whole inputs and keeping "
                        "it whole on tp, or sequence_parallel=False, fixes that."
                    ),
                    keep_whole_proposal(bf.fqn, bf.spec, match=bf.fix_match),
                ) from e
            if x is None:
                raise
            record.skipped = f"{NOT_RUN} ({type(e).__name__}: {first})"
            return x if n_out == 1 else (x, *([None] * (n_out - 1)))

    bf.compute = run


class _RandomOnPartial(TorchDispatchMode):
    """Refuses a random op whose input is a partial sum (the mask would differ per rank)."""

    def __init__(self, fqn: str, module_type: str) -> None:
        super().__init__()
        self.fqn = fqn
        self.module_type = module_type

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            for t in tensors_in((args, kwargs)):
                if isinstance(t, DTensor) and any(isinstance(p, Partial) for p in t.placements):
                    raise RandomOnPartialError(
                        f"{self.fqn} ({self.module_type}): the random op {func} runs on a partial "
                        f"sum (placements {tuple(t.placements)}), before the reduction that makes "
                        "it whole: each rank would draw its own mask for a value that exists only "
                        "after the sum. Move the dropout after the boundary's exit (it then acts "
                        "on the reduced value), set its probability to 0, or keep the boundary "
                        "whole on tp."
                    )
        return func(*args, **kwargs)


class ValidateProbe:
    """Wraps one boundary of the validate copy (see the module docstring)."""

    def __init__(
        self,
        bf: BoundaryForward,
        record: BoundaryRecord,
        params: dict[str, Any],
        on_arrival: Callable[[str, int, dict[str, tuple[int, ...]]], None] | None = None,
    ) -> None:
        self.bf = bf
        self.record = record
        self.params = params  # FQN → DTensor parameter of this region
        self.on_arrival = on_arrival  # checks what arrives against the unsharded model's shapes
        self.seen: set[tuple[Any, ...]] = set()
        self.module_type = type(bf.module).__name__
        self._inputs: list[tuple[str, DTensor, bool]] = []  # (name, tensor, declared)
        if bf.dispatch:
            bf.compute = self._compute(bf.compute)
        self.__signature__ = bf.__signature__

    def _compute(self, compute: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            self._hook_inputs(args, kwargs)
            with _RandomOnPartial(self.bf.fqn, self.module_type):
                return compute(*args, **kwargs)

        return run

    def _hook_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The region's tensor inputs that carry a gradient, declared or not, by name: the
        region's backward asks for their gradients too (:meth:`_backward`)."""
        self._inputs = []
        for name, x in _named_args(self.bf, args, kwargs):
            items = x if isinstance(x, tuple | list) else (x,)
            for j, t in enumerate(items):
                if isinstance(t, DTensor) and t.requires_grad and t.is_floating_point():
                    label = name if t is x else f"{name}[{j}]"
                    self._inputs.append((label, t, name in self.bf.inputs))

    def _undeclared_by_contract(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A local region's undeclared inputs that carry a gradient: DTensor cannot look
        inside, so the contract's rule says what their gradient is (partial on each axis the
        region shards a parameter on, as for a declared input)."""
        axes = [a for a in mesh_axes(self.bf.mesh) if grad_is_partial(self.bf.spec, a)]
        if not axes:
            return
        for name, x in _named_args(self.bf, args, kwargs):
            if (
                name not in self.bf.inputs
                and isinstance(x, torch.Tensor)
                and x.requires_grad
                and x.is_floating_point()
            ):
                seen = tuple((a, Partial()) for a in axes)
                self.record.undeclared_grads.setdefault(name, []).append(seen)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = call_key(args, kwargs)
        if self.on_arrival is not None and key not in self.seen:
            self.on_arrival(
                self.bf.fqn,
                len(self.record.shapes),
                declared_shapes(self.bf.spec, self.bf._pos, args, kwargs),
            )
        if not self.bf.dispatch and key not in self.seen:
            self._undeclared_by_contract(args, kwargs)
        if self.bf.dispatch and key not in self.seen:
            # The region's own backward, in isolation: its inputs become leaves, so that the
            # gradient of a parameter also used elsewhere (a tied weight) holds only this use.
            args, kwargs = _leaves(args), _leaves(kwargs)
        try:
            out = self.bf(*args, **kwargs)
        except HpError:
            raise
        except Exception as e:
            if not self.bf.dispatch:
                raise
            raise propose(
                VerificationError(
                    f"{self.bf.fqn} ({self.module_type}): DTensor propagation fails inside the "
                    f"region with the plan's layouts: {type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}\nThe module's code does not fit "
                    "the declared layouts (production would crash or compute something else on "
                    "local shards); keeping the boundary whole on tp fixes that."
                ),
                keep_whole_proposal(self.bf.fqn, self.bf.spec, match=self.bf.fix_match),
            ) from e
        if key in self.seen:
            return out
        self.seen.add(key)
        self.record.shapes.append(_local_shapes(out))
        if self.bf.dispatch and torch.is_grad_enabled():
            self._backward(out)
        return out

    def _backward(self, out: Any) -> None:
        outs = [t for t in tensors_in(out) if t.requires_grad and t.is_floating_point()]
        names = [n for n, p in self.params.items() if p.requires_grad]
        if not outs:
            return
        wrt = [self.params[n] for n in names] + [t for _, t, _ in self._inputs]
        with self.bf.declared_only("backward"):
            grads = torch.autograd.grad(
                outs,
                wrt,
                grad_outputs=[torch.zeros_like(t) for t in outs],
                retain_graph=True,
                allow_unused=True,
            )
        for n, g in zip(names, grads[: len(names)], strict=True):
            if g is not None:
                self.record.grads.setdefault(n, []).append(_named(g))
        for (name, _, declared), g in zip(self._inputs, grads[len(names) :], strict=True):
            if g is not None:
                seen = self.record.input_grads if declared else self.record.undeclared_grads
                seen.setdefault(name, []).append(_named(g))


class ProductionProbe:
    """Wraps one boundary of the production copy: names it when production's code fails."""

    def __init__(self, bf: BoundaryForward, record: BoundaryRecord) -> None:
        self.bf = bf
        self.record = record
        self.seen: set[tuple[Any, ...]] = set()
        self.__signature__ = bf.__signature__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = call_key(args, kwargs)
        new = key not in self.seen
        if new:
            self.record.inputs.append(declared_shapes(self.bf.spec, self.bf._pos, args, kwargs))
        try:
            out = self.bf(*args, **kwargs)
        except HpError:
            raise
        except Exception as e:
            raise propose(
                ProductionDiffersError(
                    f"{self.bf.fqn} ({type(self.bf.module).__name__}): production mode fails on "
                    f"this rank's local shards: {type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}\n"
                    "Validate mode's DTensors would hide it (they re-layout on their own), so the "
                    "plan does not fit this module: a head count or size the module reads from "
                    "its attributes, or a parameter whose layout does not match the activation it "
                    "meets. Declare the attribute in tp_divide_attrs, fix the parameter's layout, "
                    "or keep the boundary whole on tp."
                ),
                keep_whole_proposal(self.bf.fqn, self.bf.spec, match=self.bf.fix_match),
            ) from e
        if new:
            self.seen.add(key)
            self.record.shapes.append(_local_shapes(out))
            out = self._watch_undeclared(out)
        return out

    def _watch_undeclared(self, out: Any) -> Any:
        """``out``, each undeclared output that carries a gradient replaced by an alias of it
        whose hook records a gradient flowing back in from the model's code (the alias, not
        the tensor: eager attention's weights also get a gradient from inside the region)."""
        items, kind, names = self.bf.named_outputs(out)
        changed = False
        for i, x in enumerate(items):
            name = names[i] if i < len(names) else f"returned item {i}"
            if name in self.bf.outputs or not isinstance(x, torch.Tensor):
                continue
            if x.requires_grad and x.is_floating_point():
                items[i] = x.view_as(x)
                items[i].register_hook(lambda g, name=name: self.record.escaped.add(name))
                changed = True
        return self.bf.join(items, kind) if changed else out


class ShapeRecorder:
    """Wraps a boundary module of the *unsharded* copy: its global shapes, per distinct call."""

    def __init__(self, forward: Callable[..., Any], record: BoundaryRecord, spec: Any) -> None:
        self.forward = forward
        self.record = record
        self.spec = spec
        self.positions = positions(forward)
        self.seen: set[tuple[Any, ...]] = set()
        self.__signature__ = getattr(forward, "__signature__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = call_key(args, kwargs)
        new = key not in self.seen
        if new:
            self.record.inputs.append(declared_shapes(self.spec, self.positions, args, kwargs))
        try:
            out = self.forward(*args, **kwargs)
        except (
            Exception
        ) as e:  # code that cannot run on meta (flex attention): shaped like its input
            x = next((t for t in tensors_in((args, kwargs)) if t.is_floating_point()), None)
            if x is None:
                raise
            self.record.skipped = (
                f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            )
            n_out = max(1, len(self.spec.output_names()))
            out = x if n_out == 1 else (x, *([None] * (n_out - 1)))
        if new:
            self.seen.add(key)
            self.record.shapes.append(_local_shapes(out))
        return out


def declared_shapes(
    spec: Any, pos: dict[str, int], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, tuple[int, ...]]:
    """Shapes of the tensors a boundary's contract names as inputs, in this call."""
    out = {}
    for name in dict.fromkeys([*layout_map(spec.in_src), *layout_map(spec.in_dst)]):
        x = kwargs.get(name)
        if x is None and name in pos and pos[name] < len(args):
            x = args[pos[name]]
        if isinstance(x, torch.Tensor):
            out[name] = tuple((x._local_tensor if isinstance(x, DTensor) else x).shape)
    return out


class Repeater:
    """The forward of a layer-stack element shared by its repeats: each distinct call runs once.

    A call with the inputs of one already run returns its first tensor input, provided the
    first run returned a single tensor of exactly that shape and dtype (the residual stream).
    """

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward
        self.passthrough: dict[tuple[Any, ...], bool] = {}
        self.__signature__ = getattr(forward, "__signature__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = call_key(args, kwargs)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if self.passthrough.get(key) and first is not None:
            return first
        out = self.forward(*args, **kwargs)
        if key not in self.passthrough:
            same = (
                isinstance(out, torch.Tensor)
                and first is not None
                and out.shape == first.shape
                and out.dtype == first.dtype
            )
            self.passthrough[key] = bool(same)
        return out
