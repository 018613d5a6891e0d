"""A production model's optimizer state with its layouts, so DCP saves and reshards it.

A production parameter is a plain local shard, so its optimizer moments (AdamW's
``exp_avg`` / ``exp_avg_sq``, SGD's ``momentum_buffer``) are plain local shards too:
``get_optimizer_state_dict`` + ``dcp.save`` would save every rank's shard under one key as
if it were replicated. Each optimizer that holds parameters of an applied production model
therefore gets two hooks:

* ``state_dict()`` exposes every per-parameter state tensor of a sharded parameter (one
  with the local shard's shape) as a DTensor view with the parameter's layout, no copy;
  scalars such as ``step`` stay plain (identical on every rank);
* ``load_state_dict()`` turns a DTensor of any layout, or the full tensor, back into this
  rank's shard (``state_views.local_value``, as the model's own load does), and refuses a
  tensor of any other shape before anything is loaded.

Nobody has to call anything: ``apply`` registers one global optimizer step pre-hook, and an
optimizer's first ``step()`` attaches the hooks when it holds a parameter of an applied
production model (later steps cost one comparison, unless ``add_param_group`` added
parameters). ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` step a fresh
optimizer first (torch's ``_init_optim_state``), so they see the hooks. For
``optimizer.load_state_dict`` before any step, ``track_optimizer`` attaches them now.

Parameters map to names (and names to layouts, ``AppliedModel.layouts``) when a hook runs,
through the model's current ``named_parameters()``: a wrapper that swaps the parameter
objects after ``apply`` (FSDP2) keeps the names. Models and optimizers are held weakly.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from hp_core.errors import HpError
from hp_core.runtime.applied import applied, applied_module
from hp_core.runtime.clip import NotAppliedError
from hp_core.runtime.fused_state import validate_fused_value, validate_layouts
from hp_core.runtime.fused_views import fused_saved
from hp_core.runtime.journal import Journal
from hp_core.runtime.param_layout import ParamLayout
from hp_core.runtime.state_views import local_value, saved_view

__all__ = ["OptimizerStateError", "track_optimizer", "watch_optimizers"]


class OptimizerStateError(HpError, ValueError):
    """An optimizer whose state hp cannot lay out for a production model."""


#: The applied production modules whose optimizers get the hooks.
_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
#: optimizer → the models whose hooks it carries.
_HOOKED: weakref.WeakKeyDictionary[Optimizer, weakref.WeakSet[nn.Module]] = (
    weakref.WeakKeyDictionary()
)
#: optimizer → how many parameters it held when its step last looked for production models.
_LOOKED: weakref.WeakKeyDictionary[Optimizer, int] = weakref.WeakKeyDictionary()
_STEP_HOOK: list[RemovableHandle] = []  # the one global step pre-hook, once registered


def watch_optimizers(model: nn.Module, journal: Journal) -> None:
    """Give the optimizers of ``model`` (an applied production module) the state hooks."""
    _MODELS.add(model)
    journal.record(lambda: _MODELS.discard(model))
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_on_step))


def track_optimizer(model: nn.Module, optimizer: Optimizer) -> Optimizer:
    """Make ``optimizer``'s ``state_dict()`` / ``load_state_dict()`` carry ``model``'s layouts.

    Needed only to call ``optimizer.load_state_dict`` before the optimizer's first step:
    otherwise hp attaches the same hooks on that step, and
    ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` take one first. Idempotent;
    nothing to do (and nothing done) for a validate-mode model, whose states are DTensors.
    Returns ``optimizer``.
    """
    state = applied(model)
    if state is None:
        raise NotAppliedError(
            f"hp_core.track_optimizer: {type(model).__name__} was not parallelized by hp (it "
            "has no _hp_applied).\n"
            "Only a model hp_core.apply sharded needs its optimizer state laid out.\n"
            "Fix: pass the module you gave to hp_core.apply (DDP and torch.compile wrappers "
            "of it are fine)."
        )
    module = applied_module(model)
    owned = {id(p) for p in module.parameters()}
    if not any(id(p) in owned for p in _params(optimizer)):
        raise OptimizerStateError(
            f"hp_core.track_optimizer: the {type(optimizer).__name__} holds none of the "
            f"parameters of {type(module).__name__}.\n"
            "The hooks lay out the state of the model's own parameters.\n"
            "Fix: build the optimizer from this model's parameters after hp_core.apply."
        )
    if state.mode == "production" or state.fused:  # validate: re-arranged fused moments
        _attach(module, optimizer)
    return optimizer


def _params(optimizer: Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in the order its state dict numbers them."""
    return list(chain.from_iterable(g["params"] for g in optimizer.param_groups))


def _on_step(optimizer: Optimizer, _args: Any, _kwargs: Any) -> None:
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if _LOOKED.get(optimizer) == count:
        return None  # looked at already, same parameters: every later step stops here
    _LOOKED[optimizer] = count  # a group added later (add_param_group) is looked at again
    ids = {id(p) for p in _params(optimizer)}
    for model in list(_MODELS):
        if any(id(p) in ids for p in model.parameters()):
            _attach(model, optimizer)
    return None


def _attach(model: nn.Module, optimizer: Optimizer) -> None:
    hooked = _HOOKED.setdefault(optimizer, weakref.WeakSet())
    if model in hooked:
        return
    hooked.add(model)
    views = _OptimizerViews(model)
    optimizer.register_state_dict_post_hook(views.on_save)
    optimizer.register_load_state_dict_pre_hook(views.on_load)


def _is_shard_state(value: Any, param: torch.Tensor) -> bool:
    """Per-element state of ``param``: a tensor of its (local) shape. A DTensor passes too
    (a wrapper's, FSDP2 on dp): ``saved_view`` / ``local_value`` decide what it needs."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


class _OptimizerViews:
    """The state-dict hooks one optimizer carries for one production model (held weakly)."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)

    def _layouts(self, params: list[torch.Tensor]) -> dict[int, tuple[str, ParamLayout]]:
        """Position in ``params`` → (name, layout) for every sharded parameter there."""
        model = self._model()
        state = applied(model) if model is not None else None
        if model is None or state is None or not (state.layouts or state.fused):
            return {}
        layouts: Mapping[str, ParamLayout] = state.layouts or validate_layouts(model, state.fused)
        # Built per call, not cached: it costs one walk over the parameters next to a whole
        # state dict, and it stays right when a wrapper swaps the parameter objects.
        names: dict[int, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            if name in layouts:
                names.setdefault(id(param), name)
        return {
            i: (names[id(p)], layouts[names[id(p)]]) for i, p in enumerate(params) if id(p) in names
        }

    def on_save(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        params = _params(optimizer)
        sharded = self._layouts(params)
        saved = dict(state_dict["state"])
        for key, entry in state_dict["state"].items():
            if not isinstance(key, int) or key not in sharded:
                continue
            name, layout = sharded[key]
            param = params[key]
            for skey, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    if not _is_shard_state(value, param):
                        raise _unshaped(name, skey, value, param, layout)
            # A new dict: the entry is the optimizer's own per-parameter state.
            saved[key] = {
                skey: _saved(value, layout) if _is_shard_state(value, param) else value
                for skey, value in entry.items()
            }
        return {**state_dict, "state": saved}

    def on_load(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any] | None:
        groups = optimizer.param_groups
        saved_groups = state_dict.get("param_groups", [])
        if len(groups) != len(saved_groups) or any(
            len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups, strict=True)
        ):
            return None  # torch's own check names the mismatch
        params = _params(optimizer)
        sharded = self._layouts(params)
        model = self._model()
        record = applied(model) if model is not None else None
        validate = record is not None and record.mode == "validate"  # fused DTensors only
        position = {
            saved: i
            for i, saved in enumerate(chain.from_iterable(s["params"] for s in saved_groups))
        }
        # Every value is converted (and checked) before the optimizer loads any of them.
        loaded = dict(state_dict["state"])
        for key, entry in state_dict["state"].items():
            i = position.get(key)
            if i is None or i not in sharded:
                continue
            name, layout = sharded[i]
            param = params[i]
            current = optimizer.state.get(param, {})
            converted = dict(entry)
            for skey, value in entry.items():
                if not isinstance(value, torch.Tensor):
                    continue
                now = current.get(skey)
                shard_now = now is None or _is_shard_state(now, param)
                if isinstance(value, DTensor) or (value.dim() > 0 and shard_now):
                    like = now if isinstance(now, torch.Tensor) else param
                    where = f"{name} (optimizer state {skey!r})"
                    converted[skey] = (
                        validate_fused_value(where, value, layout)
                        if validate
                        else local_value(where, value, layout, like=like)
                    )
            loaded[key] = converted
        return {**state_dict, "state": loaded}


def _saved(value: torch.Tensor, layout: ParamLayout) -> Any:
    """A production shard's view; validate's re-arranged fused DTensor in the model's layout."""
    if (
        isinstance(value, DTensor)
        and layout.fused is not None
        and tuple(value.placements) == layout.placements
        and value.device_mesh == layout.mesh
    ):
        return fused_saved(value, layout.fused)
    return saved_view(value, layout)


def _unshaped(
    name: str, skey: str, value: torch.Tensor, param: torch.Tensor, layout: ParamLayout
) -> OptimizerStateError:
    return OptimizerStateError(
        f"{name} (optimizer state {skey!r}): a tensor of shape {tuple(value.shape)}, neither "
        f"a scalar nor the local shard's shape {tuple(param.shape)}; the parameter is "
        f"{layout.describe()}.\n"
        "hp lays out per-parameter state of the parameter's shape only, so it cannot say "
        "which slice of a global state this rank holds.\n"
        "Fix: use an optimizer whose per-parameter state has the parameter's shape (AdamW, "
        "Adam, SGD with momentum), or save this optimizer's state_dict() per rank with "
        "torch.save and resume it on the same layout."
    )
