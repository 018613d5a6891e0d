"""A dataflow trace of a model on the meta device: which projection feeds what.

The model runs once through ``torch.func.functional_call`` with meta copies of its
parameters and buffers and the plan's example call (:mod:`hp_core.plans.example`; by
default tiny meta token ids), so nothing of the user's model is copied, allocated or kept.
A ``TorchFunctionMode`` tags every tensor with the projections whose outputs it derives
from (reset at each projection and each norm) and records, per projection module: what its
input derives from, whether its output meets another projection's in an
activation-by-activation product (the attention product), and its widths. Embedding lookups
are recorded with whether they read the input ids. Module outputs are recorded too: whether
each module's forward returned a tuple, and which norms' outputs the code that called them
reshapes (``view``/``reshape`` in model code, with whole-sequence shapes) and which norm each
projection reads.

Tag sets are capped (a tensor derived from many projections is the residual stream), so
each op costs O(1) and the trace is linear in the model's depth.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from hp_core.errors import HpError
from hp_core.plans.example import ExampleCall, default_call

__all__ = [
    "ATTN",
    "META_ANSWERS",
    "NORM",
    "STREAM",
    "FlowTrace",
    "ModuleCall",
    "ProjectionFlow",
    "TraceFailedError",
    "experts_need_batched",
    "meta_operands",
    "trace",
]

#: Markers carried in tag sets next to projection module names.
ATTN = "<attention product>"
NORM = "<norm>"
STREAM = "<stream>"
INPUT = "<input ids>"
_MARKERS = (ATTN, NORM, STREAM, INPUT)
_CAP = 6  # more producers than this: the residual stream

_LINEAR_FUNCS: frozenset[Callable[..., Any]] = frozenset(
    {F.linear, torch.addmm, torch.mm, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}
)
_PRODUCT_FUNCS: frozenset[Callable[..., Any]] = frozenset(
    {
        F.scaled_dot_product_attention,
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.bmm,
        torch.Tensor.bmm,
        torch.baddbmm,
        torch.einsum,
    }
)
#: What a data-dependent call on a meta tensor answers: that of an ordinary, unpadded batch.
META_ANSWERS: dict[Callable[..., Any], Any] = {
    torch.Tensor.item: 0,
    torch.Tensor.__bool__: True,
    torch.Tensor.__int__: 0,
    torch.Tensor.__index__: 0,
    torch.Tensor.__contains__: False,  # "a pad token in the ids?": the unpadded batch
}
_RESHAPE_FUNCS: frozenset[Callable[..., Any]] = frozenset(
    {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten}
)
_NORM_FUNCS: frozenset[Callable[..., Any]] = frozenset(
    {F.layer_norm, F.rms_norm, F.group_norm, torch.layer_norm, torch.rms_norm}
)


def meta_operands(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """An op's operands all on meta: a tensor the model holds outside its parameters and
    buffers (gpt-fast keeps ``freqs_cis`` as a plain attribute) stays where it was built
    while the meta run's tensors are on meta; it takes part by shape and dtype only."""
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if all(t.is_meta for t in leaves) or not any(t.is_meta for t in leaves):
        return args, kwargs

    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and not v.is_meta:
            return torch.empty_like(v, device="meta")
        return v

    out: tuple[tuple[Any, ...], dict[str, Any]] = tree_map(conv, (args, kwargs))
    return out


class TraceFailedError(HpError, RuntimeError):
    """The model's forward could not run on the meta device (the planner falls back and
    records a plan note; this error never reaches the user)."""


@dataclasses.dataclass
class ProjectionFlow:
    """What the trace saw of one projection module (a Linear-like parameter owner)."""

    fqn: str
    order: int  # first call, in forward order
    in_width: int
    out_width: int
    in_ndim: int
    inputs: set[str] = dataclasses.field(default_factory=set)  # projections / markers
    feeds_attention: bool = False
    #: Its output meets itself in an attention product (q and k from one matrix).
    fused_attention: bool = False
    #: Norm modules whose output this projection reads (through any non-projection op).
    norms: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class FlowTrace:
    projections: dict[str, ProjectionFlow]
    #: Embedding module FQN → whether it looked up the model's input ids.
    embeddings: dict[str, bool]
    #: Module FQN → whether its forward returned a tuple (every module that ran).
    tuple_outputs: dict[str, bool] = dataclasses.field(default_factory=dict)
    #: Norm modules whose output the module that called them reshapes in its own code.
    reshaped_norms: set[str] = dataclasses.field(default_factory=set)
    #: Module FQN → the names of its later positional parameters that were given the very
    #: tensor its first one was (CTRL calls its attention with one tensor as v, k and q).
    first_aliases: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    #: Module FQN → the shapes of its first call's positional arguments and of what it
    #: returned (a tuple's items one by one), ``None`` for a value that is no tensor.
    calls: dict[str, ModuleCall] = dataclasses.field(default_factory=dict)


Shape = tuple[int, ...] | None


@dataclasses.dataclass(frozen=True)
class ModuleCall:
    """The shapes of one module call's positional arguments and results."""

    args: tuple[Shape, ...]
    #: What the forward returned: one shape, or a tuple's (``returned_tuple``).
    results: tuple[Shape, ...]
    returned_tuple: bool


def _shape(value: Any) -> Shape:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def is_norm_module(module: nn.Module) -> bool:
    """LayerNorm/RMSNorm-like: a norm class (by type or class name) holding only 1-D params."""
    params = list(module.parameters(recurse=False))
    if not params or any(p.dim() != 1 for p in params) or list(module.children()):
        return False
    if isinstance(module, nn.LayerNorm | nn.GroupNorm | nn.RMSNorm):
        return True
    return "norm" in type(module).__name__.lower()


class _Tagger(TorchFunctionMode):
    def __init__(self, owners: dict[int, str], ids: torch.Tensor | None) -> None:
        super().__init__()
        self.owners = owners  # id(meta param) -> owning module fqn
        self.tags: dict[int, frozenset[str]] = {} if ids is None else {id(ids): frozenset({INPUT})}
        self.keep: list[torch.Tensor] = [] if ids is None else [ids]  # ids stay unique meanwhile
        self.flows: dict[str, ProjectionFlow] = {}
        self.embeddings: dict[str, bool] = {}
        self.stack: list[str] = []  # FQNs of the modules whose forward is running
        self.norm_src: dict[int, str] = {}  # id(activation) -> the norm it derives from
        self.norm_caller: dict[str, str] = {}  # norm FQN -> the module that called it
        self.reshaped: set[str] = set()

    def _tag(self, out: Any, tags: frozenset[str]) -> None:
        if len(tags) > _CAP:
            tags = frozenset({STREAM})
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.tags[id(t)] = tags
                self.keep.append(t)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in META_ANSWERS:
            # Meta tensors hold no values: a data-dependent check (a mask's "all ones?", a
            # packed-sequence test) gets the answer of the ordinary, unpacked batch.
            return META_ANSWERS[func]
        args, kwargs = meta_operands(args, kwargs)
        out = func(*args, **kwargs)
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        owners = [self.owners[id(t)] for t in leaves if id(t) in self.owners]
        acts = [t for t in leaves if id(t) not in self.owners]
        act_tags = [self.tags.get(id(t), frozenset()) for t in acts]
        union = frozenset().union(*act_tags)
        if owners and not acts:
            # A view or cast of a parameter (``weight.T``, ``weight.to(dtype)``) is still it.
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.owners[id(t)] = owners[0]
                    self.keep.append(t)
        elif owners and func is F.embedding:
            self.embeddings.setdefault(owners[0], INPUT in union)
            self._tag(out, frozenset({f"<embed {owners[0]}>"}))
        elif owners and func in _LINEAR_FUNCS and acts:
            self._projection(owners[0], acts[0], out, union)
            self.flows[owners[0]].norms |= {
                self.norm_src[id(t)] for t in acts if id(t) in self.norm_src
            }
            return out
        elif owners and func in _NORM_FUNCS:
            self._tag(out, frozenset({NORM}))
        elif func in _PRODUCT_FUNCS and not owners and self._is_product(act_tags):
            seen: set[str] = set()
            for tags in act_tags:
                for name in tags & self.flows.keys():
                    self.flows[name].feeds_attention = True
                    if name in seen:
                        self.flows[name].fused_attention = True
                    seen.add(name)
            self._tag(out, frozenset({ATTN}))
        else:
            self._tag(out, union)
        self._follow_norm(func, acts, out)
        return out

    def _follow_norm(self, func: Callable[..., Any], acts: list[torch.Tensor], out: Any) -> None:
        """Carry a norm's output through non-projection ops; note a reshape by its caller."""
        src = next((self.norm_src[id(t)] for t in acts if id(t) in self.norm_src), None)
        if src is None:
            return
        if func in _RESHAPE_FUNCS and self.stack and self.stack[-1] == self.norm_caller.get(src):
            self.reshaped.add(src)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.norm_src[id(t)] = src

    @staticmethod
    def _is_product(act_tags: list[frozenset[str]]) -> bool:
        fed = [t for t in act_tags if t - {INPUT, NORM, STREAM}]
        return len(fed) >= 2

    def _projection(self, fqn: str, x: torch.Tensor, out: Any, union: frozenset[str]) -> None:
        flow = self.flows.get(fqn)
        width = out.shape[-1] if isinstance(out, torch.Tensor) and out.dim() else 0
        if flow is None:
            flow = self.flows[fqn] = ProjectionFlow(
                fqn, len(self.flows), x.shape[-1] if x.dim() else 0, width, x.dim()
            )
        flow.inputs |= union
        self._tag(out, frozenset({fqn}))


def experts_need_batched(config: Any) -> bool:
    """Whether a Hugging Face config selects MoE experts that cannot run on meta tensors:
    ``torch._grouped_mm``'s meta kernel accepts only bfloat16 although the CPU kernel
    computes in float32; ``batched_mm`` is the same math with plain matmuls."""
    impl = getattr(config, "_experts_implementation", "eager")
    return config is not None and impl not in (None, "eager", "batched_mm")


@contextlib.contextmanager
def _meta_kernels(model: nn.Module) -> Iterator[None]:
    """The model's MoE experts on kernels with meta implementations, and nonzero's meta
    kernel allowed, while the trace runs; the user's configs are restored after."""
    changed: list[tuple[Any, Any]] = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if (
            config is not None
            and experts_need_batched(config)
            and all(c is not config for c, _ in changed)
        ):
            changed.append((config, config._experts_implementation))
            config._experts_implementation = "batched_mm"
    # MoE routing and token selection call nonzero, whose meta kernel refuses by default;
    # the trace needs only the dataflow, for which "every element is nonzero" will do.
    nonzero = fx_config.meta_nonzero_assume_all_nonzero
    fx_config.meta_nonzero_assume_all_nonzero = True
    try:
        yield
    finally:
        fx_config.meta_nonzero_assume_all_nonzero = nonzero
        for config, impl in changed:
            config._experts_implementation = impl


def _meta_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


def _token_ids(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call's token ids: the integer tensor bound to the forward's first parameter (other
    integer inputs, such as positions or targets, are not what a token embedding reads)."""
    try:
        first = next(iter(inspect.signature(model.forward).parameters))
    except (TypeError, ValueError, StopIteration):  # pragma: no cover - introspectable forwards
        first = None
    ids = args[0] if args else kwargs.get(first) if first else None
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex:
        return None
    return ids if ids.dtype is not torch.bool else None


def trace(model: nn.Module, call: ExampleCall | None = None) -> FlowTrace:
    """Run ``model`` once on the meta device with ``call`` (default: hp's default call) and
    return what its projections feed.

    Raises :class:`TraceFailedError` when the forward cannot run on meta tensors.
    """
    owners: dict[int, str] = {}
    meta: dict[str, torch.Tensor] = {}
    by_id: dict[int, torch.Tensor] = {}
    for mfqn, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is None:
                continue
            fqn = f"{mfqn}.{pname}" if mfqn else pname
            copy = by_id.get(id(p))
            if copy is None:
                copy = by_id[id(p)] = _meta_copy(p)
                owners[id(copy)] = mfqn
            meta[fqn] = copy
        for bname, b in mod._buffers.items():
            if b is not None:
                meta[f"{mfqn}.{bname}" if mfqn else bname] = _meta_copy(b)
    names = {id(m): f for f, m in model.named_modules(remove_duplicate=False)}
    norms = {id(m) for m in model.modules() if is_norm_module(m)}
    args, kwargs = (call or default_call(model)).meta()
    tagger = _Tagger(owners, _token_ids(model, args, kwargs))
    outputs: dict[str, bool] = {}
    aliases: dict[str, tuple[str, ...]] = {}
    arg_shapes: dict[str, tuple[Shape, ...]] = {}
    calls: dict[str, ModuleCall] = {}

    def enter_hook(module: nn.Module, args: Any) -> None:
        name = names.get(id(module))
        if name is None:
            return
        if name not in aliases:
            aliases[name] = _aliases_of_first(module, args)
            arg_shapes[name] = tuple(_shape(a) for a in args)
        if id(module) in norms and tagger.stack:
            tagger.norm_caller.setdefault(name, tagger.stack[-1])
        tagger.stack.append(name)

    def norm_hook(module: nn.Module, args: Any, output: Any) -> None:
        name = names.get(id(module))
        if name is None:
            return
        if tagger.stack and tagger.stack[-1] == name:
            tagger.stack.pop()
        outputs.setdefault(name, isinstance(output, tuple | list))  # GPT-1 returns a list
        if name not in calls:
            many = isinstance(output, tuple | list)
            items = tuple(_shape(o) for o in output) if many else (_shape(output),)
            calls[name] = ModuleCall(arg_shapes.get(name, ()), items, many)
        if id(module) in norms:
            tagger._tag(output, frozenset({NORM}))
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor):
                    tagger.norm_src[id(t)] = name

    enter = nn.modules.module.register_module_forward_pre_hook(enter_hook)
    handle = nn.modules.module.register_module_forward_hook(norm_hook)
    try:
        with torch.no_grad(), _meta_kernels(model), tagger:
            torch.func.functional_call(model, meta, args, kwargs, tie_weights=False, strict=False)
    except Exception as e:  # any failure of user code on meta: the caller falls back
        raise TraceFailedError(f"{type(e).__name__}: {e}") from e
    finally:
        handle.remove()
        enter.remove()
    found = {k: v for k, v in aliases.items() if v}
    return FlowTrace(tagger.flows, tagger.embeddings, outputs, tagger.reshaped, found, calls)


def _aliases_of_first(module: nn.Module, args: tuple[Any, ...]) -> tuple[str, ...]:
    """The positional parameters of ``module.forward`` after the first that this call gave
    the same tensor as the first (each needs the first's layout: it is the same activation)."""
    if len(args) < 2 or not isinstance(args[0], torch.Tensor):
        return ()
    same = [i for i in range(1, len(args)) if args[i] is args[0]]
    if not same:
        return ()
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # pragma: no cover - every nn.Module forward is introspectable
        return ()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return tuple(positional[i] for i in same if i < len(positional))


def producers(flow: ProjectionFlow) -> set[str]:
    """The projections ``flow``'s input derives from (markers left out)."""
    return {t for t in flow.inputs if t not in _MARKERS and not t.startswith("<")}
