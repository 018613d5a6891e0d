"""Where an unexpected failure of the verifier's meta run happened, named from its traceback.

The verifier runs copies of the model, so the module objects in the traceback are the
copies' own; they are named by their path from the outermost module whose code is in the
traceback (the copy itself), which is the same path as in the user's model.
"""

from __future__ import annotations

import traceback

from torch import nn

__all__ = ["failure_site"]


def failure_site(error: BaseException) -> tuple[str, str] | None:
    """``(name, where)`` of the innermost module whose code raised ``error``, or None.

    ``name`` is the module's path from the outermost module of the traceback (``""`` when
    that is the failing one); ``where`` is ``Type.function, file line N`` of its innermost
    frame. None when no frame of the traceback runs a module's own code.
    """
    frames = [
        (frame, line)
        for frame, line in traceback.walk_tb(error.__traceback__)
        if isinstance(frame.f_locals.get("self"), nn.Module)
    ]
    if not frames:
        return None
    root: nn.Module = frames[0][0].f_locals["self"]
    names = {id(module): name for name, module in root.named_modules()}
    # The innermost frame of a module in the root's tree (the root itself always is).
    frame, line = next(f for f in reversed(frames) if id(f[0].f_locals["self"]) in names)
    module = frame.f_locals["self"]
    file = frame.f_code.co_filename.replace("\\", "/").rsplit("/", 1)[-1]
    return names[id(module)], f"{type(module).__name__}.{frame.f_code.co_name}, {file} line {line}"
