"""The call hp plans and verifies: the training step's ``model(...)``, as shapes and dtypes.

The planner runs the model's forward once on the meta device to see its dataflow, and the
verifier runs it again at apply. Which forward runs matters: nanoGPT computes only the last
position's logits when ``targets`` is absent, gpt-fast's forward cannot run without
``input_pos``. So the user may give the training call once (``plan(example_inputs=...)``,
``hp plan --example``); the plan records it (:class:`ExampleCall`) and every meta run uses it.
Without one, hp calls ``forward(ids)`` with ids of shape ``[1, 4]`` and says so when the
forward takes optional arguments that call leaves out.

Tensors are recorded by shape and dtype only (no values, no device), other arguments only
when they are plain values, so the record is small, printable and saved with the plan.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hp_core.plans.errors import PlanError

__all__ = [
    "ExampleCall",
    "ExampleCallError",
    "TensorSpec",
    "check_call",
    "default_call",
    "example_call",
    "failed_call_error",
    "left_out_note",
    "parse_example_texts",
    "training_call",
]

#: What ``plan(example_inputs=...)`` takes, in words (every message shows it).
_FORMS = (
    "a tensor, a tuple of positional arguments, a dict of keyword arguments, or a pair "
    "(args_tuple, kwargs_dict), e.g. example_inputs=((idx,), {'targets': targets})"
)
_PLAIN = (type(None), bool, int, float)
_TENSOR_TEXT = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\[\s*([0-9,\s]*)\]\s*$")


class ExampleCallError(PlanError):
    """The training call given to the planner (or the one hp would make) does not fit the
    model's forward: an argument it needs is missing, one it does not take is given, a value
    is of a kind hp cannot record, or the forward fails on it."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor argument of the call: its shape and dtype (values and device are not kept)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")

    def text(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}[{', '.join(map(str, self.shape))}]"


def _value_text(value: Any) -> str:
    return value.text() if isinstance(value, TensorSpec) else repr(value)


@dataclasses.dataclass(frozen=True)
class ExampleCall:
    """``model(*args, **kwargs)`` with every tensor a :class:`TensorSpec`.

    ``given``: the user gave it (else it is hp's default call); it takes no part in equality.
    """

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    given: bool = dataclasses.field(default=True, compare=False)

    def meta(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Fresh meta tensors for one run (a run may write into its inputs)."""

        def conv(v: Any) -> Any:
            return v.meta() if isinstance(v, TensorSpec) else v

        return tuple(conv(a) for a in self.args), {k: conv(v) for k, v in self.kwargs.items()}

    def describe(self, model: nn.Module | None = None) -> str:
        """``GPT.forward(int64[1, 4], targets=int64[1, 4])`` (what a message shows)."""
        parts = [_value_text(a) for a in self.args]
        parts += [f"{k}={_value_text(v)}" for k, v in self.kwargs.items()]
        owner = f"{type(model).__name__}." if model is not None else ""
        return f"{owner}forward({', '.join(parts)})"

    def texts(self) -> list[str]:
        """The call as ``hp plan --example`` arguments (one per argument)."""
        out = [_value_text(a) for a in self.args]
        return out + [f"{k}={_value_text(v)}" for k, v in self.kwargs.items()]

    def to_data(self) -> dict[str, Any]:
        """Plain data for a plan document: tensors as ``"dtype[dims]"`` strings."""

        def conv(v: Any) -> Any:
            return v.text() if isinstance(v, TensorSpec) else v

        data: dict[str, Any] = {}
        if self.args:
            data["args"] = [conv(a) for a in self.args]
        if self.kwargs:
            data["kwargs"] = {k: conv(v) for k, v in self.kwargs.items()}
        return data

    @classmethod
    def from_data(cls, data: Any, path: str, err: type[PlanError]) -> ExampleCall:
        """The inverse of :meth:`to_data`, every value checked (``err`` names ``path``)."""
        if not isinstance(data, Mapping) or set(data) - {"args", "kwargs"}:
            raise err(
                f"{path}: expected a mapping with 'args' (a list) and/or 'kwargs' (a mapping), "
                f"got {data!r}. Example: {{args: ['int64[2, 64]'], kwargs: {{targets: "
                "'int64[2, 64]'}}"
            )
        raw_args = data.get("args", [])
        raw_kwargs = data.get("kwargs", {})
        if not isinstance(raw_args, list) or not isinstance(raw_kwargs, Mapping):
            raise err(f"{path}: 'args' must be a list and 'kwargs' a mapping, got {data!r}.")
        args = tuple(_stored(v, f"{path}.args[{i}]", err) for i, v in enumerate(raw_args))
        kwargs = {
            _name(k, f"{path}.kwargs", err): _stored(v, f"{path}.kwargs.{k}", err)
            for k, v in raw_kwargs.items()
        }
        return cls(args, kwargs)


def _name(key: Any, path: str, err: type[PlanError]) -> str:
    if not isinstance(key, str) or not key.isidentifier():
        raise err(f"{path}: argument names must be Python identifiers, got {key!r}.")
    return key


def _parse_tensor(text: str, path: str, err: type[PlanError]) -> TensorSpec:
    m = _TENSOR_TEXT.match(text)
    dtype = getattr(torch, m.group(1), None) if m else None
    if m is None or not isinstance(dtype, torch.dtype):
        raise err(
            f"{path}: {text!r} is not a tensor as hp writes one: a torch dtype name and its "
            "shape, e.g. 'int64[2, 64]' or 'float32[2, 64, 128]'."
        )
    dims = [d.strip() for d in m.group(2).split(",") if d.strip()]
    return TensorSpec(tuple(int(d) for d in dims), dtype)


def _stored(value: Any, path: str, err: type[PlanError]) -> Any:
    if isinstance(value, str):
        return _parse_tensor(value, path, err)
    if isinstance(value, _PLAIN):
        return value
    raise err(
        f"{path}: expected a tensor written 'dtype[dims]' or a plain value (null, true/false, a "
        f"number), got {type(value).__name__} {value!r}."
    )


def _recorded(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(int(n) for n in value.shape), value.dtype)
    if isinstance(value, _PLAIN):
        return value
    raise ExampleCallError(
        f"plan(example_inputs=...): {where} is a {type(value).__name__}; hp records tensors "
        "(by shape and dtype) and plain values (None, bool, int, float) only. Fix: pass the "
        "tensors and flags the forward takes; state the forward builds itself (caches, position "
        "tables) is read from the model, not from the call."
    )


def example_call(inputs: Any) -> ExampleCall:
    """Record the user's training call (any of the forms in ``plan``'s docstring)."""
    if isinstance(inputs, ExampleCall):
        return inputs
    args: tuple[Any, ...]
    kwargs: Mapping[Any, Any]
    if isinstance(inputs, Mapping):
        args, kwargs = (), inputs
    elif (
        isinstance(inputs, tuple)
        and len(inputs) == 2
        and isinstance(inputs[0], tuple | list)
        and isinstance(inputs[1], Mapping)
    ):
        args, kwargs = tuple(inputs[0]), inputs[1]
    elif isinstance(inputs, tuple | list):
        args, kwargs = tuple(inputs), {}
    elif isinstance(inputs, torch.Tensor):
        args, kwargs = (inputs,), {}
    else:
        raise ExampleCallError(
            f"plan(example_inputs=...): got {type(inputs).__name__}; expected {_FORMS}."
        )
    for key in kwargs:
        if not isinstance(key, str) or not key.isidentifier():
            raise ExampleCallError(
                f"plan(example_inputs=...): keyword {key!r} is not an argument name; expected "
                f"{_FORMS}."
            )
    return ExampleCall(
        tuple(_recorded(a, f"positional argument {i}") for i, a in enumerate(args)),
        {k: _recorded(v, f"argument {k!r}") for k, v in kwargs.items()},
    )


def parse_example_texts(texts: Sequence[str]) -> ExampleCall:
    """``hp plan --example`` arguments: ``'int64[2, 64]'`` (positional, in order) or
    ``'NAME=int64[2, 64]'`` / ``'NAME=true'`` (keyword)."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for text in texts:
        name, eq, value = text.partition("=")
        if not eq:
            if kwargs:
                raise ExampleCallError(
                    f"--example {text!r}: a positional argument after keyword ones; give the "
                    "positional arguments first."
                )
            args.append(_parse_tensor(text, f"--example {text!r}", ExampleCallError))
            continue
        key = _name(name.strip(), f"--example {text!r}", ExampleCallError)
        plain = {"true": True, "false": False, "none": None, "null": None}
        word = value.strip().lower()
        if word in plain:
            kwargs[key] = plain[word]
        elif re.fullmatch(r"-?[0-9]+", word):
            kwargs[key] = int(word)
        else:
            kwargs[key] = _parse_tensor(value, f"--example {text!r}", ExampleCallError)
    return ExampleCall(tuple(args), kwargs)


def _parameters(model: nn.Module) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # pragma: no cover - every nn.Module forward is introspectable
        return []


def default_call(model: nn.Module) -> ExampleCall:
    """hp's call when the user gives none: token ids ``[1, 4]`` (``use_cache=False`` where the
    forward takes it, so no cache is built)."""
    names = {p.name for p in _parameters(model)}
    kwargs = {"use_cache": False} if "use_cache" in names else {}
    return ExampleCall((TensorSpec((1, 4), torch.long),), kwargs, given=False)


def _supply(call: ExampleCall) -> str:
    return (
        "the example" if call.given else f"hp's default call {call.describe()} (nothing was given)"
    )


def check_call(model: nn.Module, call: ExampleCall) -> None:
    """Refuse a call the forward's signature cannot take, naming the argument and the fix."""
    params = _parameters(model)
    kinds = inspect.Parameter
    if not params:  # pragma: no cover - see _parameters
        return
    by_position = (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    positional = [p for p in params if p.kind in by_position]
    var_pos = any(p.kind is kinds.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind is kinds.VAR_KEYWORD for p in params)
    fwd = f"{type(model).__name__}.forward"
    fix = (
        "Fix: give the call your training step makes: plan(model, mesh, example_inputs=(args, "
        "kwargs)) (tensors are read for shape and dtype only), or on the command line "
        "--example 'int64[2, 64]' --example 'NAME=int64[2, 64]'."
    )
    if len(call.args) > len(positional) and not var_pos:
        raise ExampleCallError(
            f"plan(): {fwd} takes {len(positional)} positional argument(s) but {_supply(call)} "
            f"passes {len(call.args)}. {fix}"
        )
    by_name = {p.name: p for p in params}
    bound = {p.name for p in positional[: len(call.args)]}
    for key in call.kwargs:
        p = by_name.get(key)
        if (p is None and not var_kw) or (p is not None and p.kind is kinds.POSITIONAL_ONLY):
            raise ExampleCallError(
                f"plan(): {fwd} has no keyword argument {key!r}, which {_supply(call)} passes. "
                f"Its arguments: {', '.join(by_name)}. {fix}"
            )
        if key in bound:
            raise ExampleCallError(
                f"plan(): {_supply(call)} gives {fwd}'s argument {key!r} twice (by position and "
                f"by name). {fix}"
            )
        bound.add(key)
    for p in params:
        variadic = p.kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
        needed = p.default is kinds.empty and not variadic
        if needed and p.name not in bound:
            raise ExampleCallError(
                f"plan(): {fwd} needs its argument {p.name!r}, which {_supply(call)} leaves out, "
                f"so hp cannot run the forward to plan it. {fix}"
            )


def training_call(model: nn.Module, example_inputs: Any) -> ExampleCall:
    """The call to plan ``model`` on: ``example_inputs`` recorded (hp's default call when it is
    None), checked against the forward's signature."""
    call = default_call(model) if example_inputs is None else example_call(example_inputs)
    check_call(model, call)
    return call


def failed_call_error(
    model: nn.Module, call: ExampleCall, error: BaseException
) -> ExampleCallError:
    """The error for a call the user gave whose forward fails on the meta device."""
    return ExampleCallError(
        f"plan(example_inputs=...): {call.describe(model)} failed on the meta device: {error}. "
        "hp runs the call on meta tensors (shapes and dtypes, no values) to see the model's "
        "dataflow. Fix: give the call the training step makes (argument names, shapes, dtypes "
        "as the forward expects them, after any setup such as caches the forward reads); code "
        "that reads tensor values (.item(), .tolist()) cannot run on meta."
    )


def _is_transformers_model(model: nn.Module) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
        for c in type(model).__mro__
    )


def left_out_note(model: nn.Module, call: ExampleCall) -> str | None:
    """A plan note when hp traced its default call and the forward takes optional arguments
    (default ``None``) that call leaves out: the training step may take another path.

    transformers models are left out: their documented training call (ids and labels) runs the
    same layers as the default one.
    """
    if call.given or _is_transformers_model(model):
        return None
    given = {p.name for p in _parameters(model)[: len(call.args)]} | set(call.kwargs)
    left = [p.name for p in _parameters(model) if p.default is None and p.name not in given]
    if not left:
        return None
    return (
        f"traced {call.describe(model)} (hp's default call); the forward also takes "
        f"{', '.join(left)}, left out here: if the training step passes them the forward may "
        "take another path than the one planned and verified. Give the training call with "
        "plan(..., example_inputs=...) or hp plan --example"
    )
