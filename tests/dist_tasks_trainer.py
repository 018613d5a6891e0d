"""Rank-side tasks: the HF Trainer example run inside a gloo world (so coverage measures it)."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hf_trainer_train.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("hf_trainer_train", _EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trainer_run(plain: bool) -> dict[str, Any]:
    """``examples/hf_trainer_train.py --check`` (or ``--plain``) on this world's ranks."""
    # accelerate reads the launcher's environment to see a distributed job; the world's
    # process group already exists, so it only records it.
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
        }
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    args = argparse.Namespace(model="llama", tp=2, check=not plain, plain=plain)
    try:
        return {"ok": bool(_example().train(args)), "type": None, "message": ""}
    except Exception as e:
        return {"ok": False, "type": type(e).__name__, "message": str(e)}
