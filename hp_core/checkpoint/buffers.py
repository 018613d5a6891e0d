"""Non-persistent buffers of a meta-built model, recomputed rather than loaded.

A checkpoint holds no non-persistent buffer (rotary ``inv_freq`` and ``original_inv_freq``,
Gemma's ``embed_scale``): ``from_pretrained`` recomputes them with the model's own
``_init_weights``, which transformers 5 writes for exactly these buffers (the rotary
classes' ``rope_init_fn``, the scaled embedding's scale). ``recompute_buffers`` does the
same, on a shallow stand-in of each owning module whose parameters are meta tensors of
their global shape (so the init's writes to parameters go nowhere and an index such as
the padding row stays in range) and whose buffers are fresh tensors on the target device.
The model is not touched; the caller installs the returned buffers. A buffer the init
leaves unwritten (filled with NaN first, still NaN after) is reported, never installed.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping

import torch
from torch import nn

__all__ = ["non_persistent_buffers", "recompute_buffers"]


def non_persistent_buffers(
    model: nn.Module,
) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """``(full name, owning module, attribute, buffer)`` of every non-persistent buffer."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name in module._non_persistent_buffers_set:
            buffer = module._buffers.get(name)
            if buffer is not None:
                yield (f"{prefix}.{name}" if prefix else name), module, name, buffer


def recompute_buffers(
    model: nn.Module,
    device: torch.device,
    global_shapes: Mapping[int, torch.Size],
) -> tuple[dict[str, tuple[nn.Module, str, torch.Tensor]], list[str]]:
    """``name → (owner, attribute, value)`` of every non-persistent buffer, recomputed on
    ``device``, and the names of those nothing recomputed.

    ``global_shapes`` maps ``id(parameter)`` to its global shape (a production shard's
    local shape is not what the init indexes).
    """
    init = getattr(model, "_init_weights", None)
    done: dict[str, tuple[nn.Module, str, torch.Tensor]] = {}
    unset: list[str] = []
    owners: dict[int, tuple[nn.Module, dict[str, tuple[str, torch.Tensor]]]] = {}
    for full, module, name, buffer in non_persistent_buffers(model):
        owners.setdefault(id(module), (module, {}))[1][name] = (full, buffer)
    for module, names in owners.values():
        stand_in = copy.copy(module)  # shallow: a new module object over copied dicts
        stand_in._parameters = {
            n: None
            if p is None
            else nn.Parameter(
                torch.empty(global_shapes.get(id(p), p.shape), dtype=p.dtype, device="meta"),
                requires_grad=False,
            )
            for n, p in module._parameters.items()
        }
        stand_in._modules = {}
        stand_in._buffers = dict(module._buffers)
        fresh = {}
        for name, (_full, old) in names.items():
            # NaN marks "not written" (zero for integer buffers, which cannot be marked).
            fill = float("nan") if old.is_floating_point() else 0
            value = torch.full(old.shape, fill, dtype=old.dtype, device=device)
            fresh[name] = stand_in._buffers[name] = value
        if callable(init):
            try:
                with torch.no_grad():
                    init(stand_in)
            except Exception:  # the model's own init fails on a stand-in (transformers' Gemma-3n
                pass  # reads an attribute its causal-LM class lacks): its buffers count as unset
        for name in fresh:
            written = stand_in._buffers[name]  # an init may rebind rather than write in place
            if written is None or (written.is_floating_point() and bool(written.isnan().any())):
                unset.append(names[name][0])
            else:
                done[names[name][0]] = (module, name, written.to(device))
    return done, unset
