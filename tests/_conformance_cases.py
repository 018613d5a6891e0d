"""Factories of the conformance-suite tests (importable by the spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from hp_core.testing.families import family_batch


def batch_differing_per_rank(step: int) -> dict[str, Any]:
    """A broken batch factory: every rank draws other token ids, so tp ranks disagree."""
    ids = family_batch("llama", seed=100 * dist.get_rank() + step)
    return {"input_ids": ids, "labels": ids, "use_cache": False}
