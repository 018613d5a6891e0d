"""The checks a load runs before it reads a value: does this checkpoint fit this model?

``read_metadata`` reads ``.metadata`` (keys, global shapes, dtypes, and for each stored
chunk its file, offset and length). ``check_fit`` compares it with what the load will fill
(the model's state dict, flattened the way DCP keys it): every key present, with the
same global shape and dtype, and, unless the load is lenient, no key the model lacks.
DCP reshards a checkpoint to any mesh and plan, so a global shape is all a layout has to
match; a mismatch is a checkpoint of another model (or config). ``planned_reads`` asks
DCP's own load planner which byte ranges this rank will read, and ``check_files`` makes
sure those files exist and are long enough.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor

from hp_core.checkpoint.dcp_checksums import Checksums, crc_of_file
from hp_core.checkpoint.dcp_errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointMissingFileError,
)
from hp_core.runtime.param_layout import layout_of

__all__ = ["Read", "check_files", "check_fit", "flat_target", "planned_reads", "read_metadata"]

_SHOWN = 8  # keys listed in one message


@dataclasses.dataclass(frozen=True)
class Read:
    """One stored item this rank reads: the key, and where its bytes are."""

    key: str
    file: str
    offset: int
    length: int


def read_metadata(root: str, checksums: Checksums | None) -> Metadata:
    """The checkpoint's ``.metadata``, or the error that says why it cannot be had."""
    path = os.path.join(root, ".metadata")
    if not os.path.isfile(path):
        where = "the directory does not exist" if not os.path.isdir(root) else "no such file"
        raise CheckpointMissingFileError(
            f"{path}: {where}.\n"
            "A DCP checkpoint is a directory with a .metadata file and .distcp storage files.\n"
            "Fix: pass the directory that dcp.save / save_checkpoint wrote (and copy it whole)."
        )
    if checksums is not None and crc_of_file(path) != checksums.metadata_crc:
        raise CheckpointCorruptError(
            f"{path}: fails its checksum in {checksums.path}.\n"
            "The file was changed or damaged after it was saved.\n"
            "Fix: restore the checkpoint from an intact copy."
        )
    try:
        metadata = FileSystemReader(root).read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError) as err:
        raise CheckpointCorruptError(
            f"{path}: unreadable ({type(err).__name__}: {err}).\n"
            "Fix: restore the checkpoint from an intact copy; .metadata cannot be rebuilt "
            "from the storage files."
        ) from err
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointCorruptError(
            f"{path}: holds a {type(metadata).__name__}, not DCP metadata.\n"
            "Fix: pass the directory of a checkpoint written by dcp.save / save_checkpoint."
        )
    return metadata


def flat_target(target: Mapping[str, Any]) -> dict[str, Any]:
    """``target`` keyed as DCP keys it (nested dicts joined with dots)."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(dict(target), None, False)
    return dict(planner.state_dict)


def _model_form(value: Any) -> str:
    if isinstance(value, DTensor):
        layout = layout_of(value)
        form = layout.describe() if layout is not None else f"{tuple(value.shape)} replicated"
        return f"{form} {value.dtype}"
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype} (a plain tensor)"
    return f"a {type(value).__name__} (not a tensor)"


def _saved_form(md: Any) -> str:
    if not isinstance(md, TensorStorageMetadata):
        return "an object (not a tensor)"
    chunks = ", ".join(f"{tuple(c.sizes)} at {tuple(c.offsets)}" for c in md.chunks[:4])
    more = f", ... ({len(md.chunks)} in all)" if len(md.chunks) > 4 else ""
    return f"{tuple(md.size)} {md.properties.dtype}, saved as chunks {chunks}{more}"


def _listed(keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:_SHOWN])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > _SHOWN else "")


def check_fit(
    root: str,
    metadata: Metadata,
    target: Mapping[str, Any],
    *,
    strict: bool,
    ignored_prefixes: Sequence[str],
) -> None:
    """Raise ``CheckpointMismatchError`` unless ``metadata`` holds every key of ``target``
    (flat) with its global shape and dtype; with ``strict``, also when it holds keys that
    ``target`` lacks (those under ``ignored_prefixes`` excepted)."""
    saved = metadata.state_dict_metadata
    missing = [k for k in target if k not in saved]
    if missing:
        optimizer_only = all(k.startswith("optimizer.") for k in missing)
        fix = (
            "pass optimizer=None to load the model only, or load a checkpoint saved with "
            "its optimizer"
            if optimizer_only
            else "load a checkpoint saved from this model (same family and config)"
        )
        raise CheckpointMismatchError(
            f"{missing[0]}: not in the checkpoint {root} ({len(missing)} keys missing: "
            f"{_listed(missing)}).\nThe checkpoint holds {len(saved)} keys, e.g. "
            f"{_listed(sorted(saved)[:3])}.\nFix: {fix}."
        )
    wrong = []
    for key, value in target.items():
        md = saved[key]
        is_tensor = isinstance(value, torch.Tensor)
        if is_tensor != isinstance(md, TensorStorageMetadata) or (
            isinstance(md, TensorStorageMetadata)
            and (tuple(md.size) != tuple(value.shape) or md.properties.dtype != value.dtype)
        ):
            wrong.append(f"{key}: checkpoint {_saved_form(md)}; model {_model_form(value)}")
    if wrong:
        raise CheckpointMismatchError(
            f"{wrong[0].partition(':')[0]}: the checkpoint {root} holds another shape or dtype "
            f"than the model ({len(wrong)} keys):\n  " + "\n  ".join(wrong[:_SHOWN]) + "\n"
            "DCP reshards a checkpoint to any mesh and plan, so only the global shape and the "
            "dtype must match: this checkpoint is of another model or config.\n"
            "Fix: build the model with the config the checkpoint was saved from (and cast it "
            "to the saved dtype), then load."
        )
    unexpected = sorted(
        k for k in saved if k not in target and not k.startswith(tuple(ignored_prefixes))
    )
    if strict and unexpected:
        raise CheckpointMismatchError(
            f"{unexpected[0]}: in the checkpoint {root} but not in the model "
            f"({len(unexpected)} unexpected keys: {_listed(unexpected)}).\n"
            "Fix: load a checkpoint of this model, or pass strict=False to ignore the keys "
            "the model does not have."
        )
    for key, md in saved.items():
        if key in target and isinstance(md, TensorStorageMetadata):
            covered = sum(math.prod(c.sizes) for c in md.chunks)
            if covered != math.prod(md.size):
                raise CheckpointCorruptError(
                    f"{key}: {root}/.metadata lists chunks of {covered} elements for a "
                    f"tensor of {math.prod(md.size)} ({_saved_form(md)}).\n"
                    "Fix: restore the checkpoint from an intact copy."
                )


def planned_reads(metadata: Metadata, target: Mapping[str, Any]) -> list[Read]:
    """The stored items this rank will read to fill ``target``, as DCP's planner plans them."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(dict(target), metadata, False)
    reads = []
    for item in planner.create_local_plan().items:
        info = metadata.storage_data[item.storage_index]
        reads.append(Read(item.dest_index.fqn, info.relative_path, info.offset, info.length))
    return reads


def check_files(root: str, reads: Sequence[Read], rank: int) -> None:
    """Raise unless every file of ``reads`` exists and holds the bytes read from it."""
    by_file: dict[str, list[Read]] = {}
    for read in reads:
        by_file.setdefault(read.file, []).append(read)
    for name, items in sorted(by_file.items()):
        path = os.path.join(root, name)
        keys = sorted({r.key for r in items})
        if not os.path.isfile(path):
            raise CheckpointMissingFileError(
                f"{path}: missing; rank {rank} reads {len(keys)} keys from it "
                f"({_listed(keys)}).\n"
                "Fix: copy the whole checkpoint directory again (.metadata and every .distcp "
                "file belong together)."
            )
        size = os.path.getsize(path)
        short = [r for r in items if r.offset + r.length > size]
        if short:
            first = min(short, key=lambda r: r.offset)
            raise CheckpointCorruptError(
                f"{path}: truncated: {size} bytes, but {first.key} is stored at bytes "
                f"{first.offset}..{first.offset + first.length} ({len(short)} items "
                "past the end).\n"
                "Fix: copy the checkpoint again from an intact source (an interrupted copy or "
                "a full disk truncates files)."
            )
