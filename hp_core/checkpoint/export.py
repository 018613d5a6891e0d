"""A full, unsharded state dict of a parallelized model, under the names it had before apply.

``iter_full_state_dict`` walks the state dict of the module ``apply`` was given and, one
entry at a time, gathers the full tensor (``hp_core.checkpoint.gather``: production
shards through their recorded layouts, validate DTensors, expert parameters on the
expert mesh, FSDP2's DTensors over dp), moves it to ``device``, yields it and keeps no
reference to it, so a rank holds at most one full tensor (plus its shards) at any moment.
Expert parameters ``apply`` stacked (``StackedExperts``) are split back into the
per-expert keys of ``original_names``. Everything else (replicated parameters, persistent
buffers) is the model's own tensor, as ``model.state_dict()`` gives it; non-persistent
buffers are not in a state dict.

With ``rank0_only`` only rank 0 yields anything; the others take part in the gathers,
so every rank iterates to the end. ``full_state_dict`` collects the stream into a dict
and gives tied parameters one tensor under each of their names, as ``model.state_dict()``
does, so ``save_pretrained(dir, state_dict=...)`` writes a tie once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hp_core.checkpoint.export_errors import ExportArgumentError, ExportNotAppliedError
from hp_core.checkpoint.gather import full_value
from hp_core.checkpoint.names import original_names
from hp_core.runtime.applied import applied, applied_module

__all__ = ["full_state_dict", "iter_full_state_dict"]


def _device(where: str, device: Any) -> torch.device:
    try:
        out = torch.device(device)
    except (RuntimeError, TypeError):
        out = None
    if out is None or out.type == "meta":
        raise ExportArgumentError(
            f"hp_core.{where}: device={device!r} is not a device a full tensor can be held on.\n"
            "Fix: pass device='cpu' (the default), or the accelerator's device, e.g. 'cuda'."
        )
    return out


def _checked(where: str, model: Any, rank0_only: Any, device: Any) -> torch.device:
    if not isinstance(rank0_only, bool):
        raise ExportArgumentError(
            f"hp_core.{where}: rank0_only={rank0_only!r} is not a bool.\n"
            "Fix: pass rank0_only=True (only rank 0 gets the tensors) or False (every rank)."
        )
    where_to = _device(where, device)
    if not isinstance(model, nn.Module) or applied(model) is None:
        name = type(model).__name__
        raise ExportNotAppliedError(
            f"hp_core.{where}: {name} was not parallelized by hp (it has no _hp_applied; "
            "apply() sets it on the module it is given), so hp knows no layout to gather.\n"
            "Fix: pass the module you gave to hp_core.apply (DDP, FSDP2 and torch.compile "
            "wrappers of it are fine); a model hp did not apply is whole already: use "
            "model.state_dict()."
        )
    return where_to


def _stream(
    model: nn.Module, rank0_only: bool, device: torch.device, ties: bool
) -> Iterator[tuple[str, Any]]:
    module = applied_module(model)
    record = applied(module)
    layouts = record.layouts if record is not None else {}
    names = original_names(module)
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    state = module.state_dict()
    earlier = _earlier_names(module, list(state)) if ties else {}
    heads = set(earlier.values())
    shared: dict[str, Any] = {}  # the tensors of tied parameters' first names
    for key in list(state):
        value = state.pop(key)
        full: Any
        if key in earlier:  # a tied parameter, gathered under its first name (on every rank)
            full = shared.get(earlier[key])
        else:
            full = full_value(value, layouts.get(key), rank0_only, key)
        del value
        if not keep:
            del full
            continue
        if isinstance(full, torch.Tensor):
            full = full.to(device)
        if key in heads:
            shared[key] = full
        sources = names[key]
        if len(sources) == 1:
            # Handed over, not kept: once the caller drops it, the tensor is freed.
            box = [full]
            del full
            yield sources[0], box.pop()
        else:  # stacked experts: row i is expert i, a tensor of its own (not a view)
            for i, name in enumerate(sources):
                yield name, full[i].clone()
            del full


def _earlier_names(module: nn.Module, keys: list[str]) -> dict[str, str]:
    """``key → the first of keys`` naming the same parameter or buffer, for every later name."""
    ids = {
        name: id(tensor)
        for name, tensor in (
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        )
    }
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for key in keys:
        if key not in ids:
            continue
        head = first.setdefault(ids[key], key)
        if head != key:
            out[key] = head
    return out


def iter_full_state_dict(
    model: nn.Module, *, rank0_only: bool = True, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(original name, full tensor on device)`` for every entry of ``model``'s state
    dict, gathering one tensor at a time (a collective: every rank must iterate to the end).

    ``rank0_only=True``: rank 0 gets the tensors, the other ranks send their pieces and yield
    nothing. A tied parameter is gathered again under each of its names, so at most one
    full tensor is alive in the iterator. Raises ``ExportNotAppliedError`` for a model hp
    did not apply and ``ExportArgumentError`` for a bad argument, before any collective.
    """
    where = _checked("iter_full_state_dict", model, rank0_only, device)
    return _stream(model, rank0_only, where, ties=False)


def full_state_dict(
    model: nn.Module, *, rank0_only: bool = True, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The full, unsharded state dict of ``model`` under its names from before ``apply``.

    What ``model.save_pretrained(dir, state_dict=...)`` takes on rank 0 (collective: every
    rank calls it). With ``rank0_only=True`` the other ranks get ``{}``. Tied parameters
    are one tensor under each of their names. See ``iter_full_state_dict``.
    """
    where = _checked("full_state_dict", model, rank0_only, device)
    return dict(_stream(model, rank0_only, where, ties=True))
