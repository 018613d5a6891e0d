"""``--model pkg.mod:factory``: a zero-arg callable of the user's that returns an ``nn.Module``.

The user typed the import path on their own command line, so importing it is their
explicit choice (unlike an import path inside a plan file, which
:func:`hp_core.resolve.trusted_packages` guards). As ``python -m`` does, the current
directory is importable. The factory is called under ``torch.device("meta")``, so a
model built the usual way allocates no memory (one that builds real weights anyway is
only slower). Every failure is a usage error (exit 2) naming the string and the fix.
"""

from __future__ import annotations

import importlib
import os
import re
import sys

import torch
from torch import nn

from hp_core.cli.failure import CommandFailed, one_line
from hp_core.spec.keywords import close_matches

__all__ = ["is_factory_path", "load_factory_model"]

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_EXAMPLE = "e.g. --model mypkg.models:build_model"


def is_factory_path(model: str) -> bool:
    """Whether ``--model`` names ``module:callable`` (not a path such as ``C:\\cfg.json``)."""
    return ":" in model and not any(c in model for c in "/\\") and not model.endswith(".json")


def _usage(model: str, message: str) -> CommandFailed:
    return CommandFailed(2, f"--model {model!r}: {message}")


def load_factory_model(model: str) -> nn.Module:
    """Import ``pkg.mod``, call its ``factory()`` on the meta device; the module it returns."""
    module_name, _, attr = model.partition(":")
    if not _DOTTED.fullmatch(module_name) or not _DOTTED.fullmatch(attr):
        raise _usage(
            model,
            "not a module:callable path. Fix: name an importable module and a zero-arg "
            f"callable in it that returns the nn.Module, {_EXAMPLE}.",
        )
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # like python -m: a module beside the user is importable
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or any error raised while the module runs
        raise _usage(
            model,
            f"cannot import {module_name!r} ({one_line(e)}). Fix: run hp "
            "from the folder that holds it, or put it on PYTHONPATH (or install its package).",
        ) from None
    target: object = module
    for part in attr.split("."):
        if not hasattr(target, part):
            names = [n for n in dir(target) if not n.startswith("_")]
            best = close_matches(part, names, n=1)
            hint = f" Did you mean {best[0]!r}?" if best else ""
            raise _usage(
                model,
                f"{module_name!r} has no attribute {part!r}.{hint} Fix: name a zero-arg callable "
                f"defined in {module_name!r}.",
            )
        target = getattr(target, part)
    if not callable(target):
        raise _usage(
            model,
            f"{attr!r} is a {type(target).__name__}, not a callable. Fix: name a zero-arg "
            "function (or class) that returns the nn.Module.",
        )
    try:
        with torch.device("meta"):
            built = target()
    except Exception as e:  # whatever the user's factory raises is reported in one line
        raise _usage(
            model,
            f"calling {attr}() raised {one_line(e)}. Fix: make it callable "
            "with no arguments (it runs under torch.device('meta')).",
        ) from None
    if not isinstance(built, nn.Module):
        raise _usage(
            model,
            f"{attr}() returned {type(built).__name__}, not a torch.nn.Module. Fix: return the "
            "model itself.",
        )
    return built
