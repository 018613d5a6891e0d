"""Snapshots of everything apply may touch on a model, compared after a failed call."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["differences", "snapshot"]

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_forward_hooks_always_called",
)


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything apply may touch, by identity and by value."""
    return {
        "params": [
            (n, id(p), p.requires_grad, p.dtype, p.detach().clone())
            for n, p in model.named_parameters(remove_duplicate=False)
        ],
        "buffers": [(n, id(b), b.clone()) for n, b in model.named_buffers(remove_duplicate=False)],
        "modules": [(n, id(m), type(m)) for n, m in model.named_modules(remove_duplicate=False)],
        "attrs": {n: {k: id(v) for k, v in vars(m).items()} for n, m in model.named_modules()},
        "hooks": {
            n: [list(getattr(m, h).items()) for h in _HOOK_DICTS] for n, m in model.named_modules()
        },
        "global_hooks": [
            len(torch.nn.modules.module._global_forward_hooks),
            len(torch.nn.modules.module._global_forward_pre_hooks),
        ],
    }


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two snapshots (empty: the model is exactly as it was)."""
    if len(a["params"]) != len(b["params"]) or len(a["buffers"]) != len(b["buffers"]):
        return ["parameter or buffer count changed"]
    out: list[str] = []
    for (n, i, rg, dt, x), (n2, i2, rg2, dt2, y) in zip(a["params"], b["params"], strict=True):
        if (n, i, rg, dt) != (n2, i2, rg2, dt2):
            out.append(f"param {n}: object/requires_grad/dtype changed")
        elif x.shape != y.shape or not torch.equal(x, y):
            out.append(f"param {n}: values changed")
    for (n, i, x), (n2, i2, y) in zip(a["buffers"], b["buffers"], strict=True):
        if (n, i) != (n2, i2) or not torch.equal(x, y):
            out.append(f"buffer {n} changed")
    for key in ("modules", "attrs", "hooks", "global_hooks"):
        if a[key] != b[key]:
            out.append(f"{key} changed")
    return out
