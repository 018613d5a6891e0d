"""The tensors inside a forward's inputs or outputs.

They nest in tuples, lists, dicts and HF ``ModelOutput``s.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tensors_in"]


def tensors_in(x: Any) -> list[torch.Tensor]:
    """Every tensor in ``x``, in order (a ``ModelOutput`` is walked through its ``to_tuple()``)."""
    found: list[torch.Tensor] = []

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, dict):
            for item in v.values():
                walk(item)
        elif isinstance(v, list | tuple):
            for item in v:
                walk(item)
        elif hasattr(v, "to_tuple"):
            walk(v.to_tuple())

    walk(x)
    return found
