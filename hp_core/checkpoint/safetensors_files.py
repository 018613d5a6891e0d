"""A Hugging Face checkpoint directory, read by header: which tensor is where, and slices.

``CheckpointFiles.open(path)`` finds the files (``model.safetensors``, or the shards an
``model.safetensors.index.json`` names), parses every header itself and checks it against
the file's size, so a truncated or corrupt file is refused by name before any data is read
(reading past the end of a memory-mapped file would kill the process, not raise).
``read_slice`` reads one slice of one tensor through safetensors' lazy ``get_slice``:
only the bytes of that slice leave the disk.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from hp_core.checkpoint.pretrained_errors import (
    CheckpointNotFoundError,
    CorruptSafetensorsError,
    MissingShardFileError,
)

__all__ = ["CheckpointFiles", "TensorEntry", "read_slice"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

#: safetensors' dtype names → torch dtypes (the ones torch has).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of the checkpoint, as its file's header describes it."""

    key: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def _corrupt(file: Path, why: str) -> CorruptSafetensorsError:
    return CorruptSafetensorsError(
        f"{file}: not a complete safetensors file: {why}.\n"
        "Fix: re-download or re-save this file (save_pretrained / safetensors.torch.save_file); "
        "a copy interrupted mid-way leaves a file shorter than its header says."
    )


def _header(file: Path) -> dict[str, TensorEntry]:
    """Parse ``file``'s header and check every tensor's bytes lie inside the file."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _corrupt(file, f"the file has {size} bytes, fewer than the 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise _corrupt(file, f"the header says it is {length} bytes, the file has {size}")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(file, f"its JSON header does not parse ({e})") from None
    if not isinstance(header, dict):
        raise _corrupt(file, "its header is not a JSON object")
    data = size - 8 - length
    entries: dict[str, TensorEntry] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise _corrupt(file, f"the header entry of {key!r} is malformed: {info!r}") from None
        need = math.prod(shape) * dtype.itemsize
        if end - begin != need:
            raise _corrupt(file, f"{key!r} spans {end - begin} bytes but {shape} needs {need}")
        if end > data:
            raise _corrupt(
                file, f"{key!r} ends at data byte {end}, but the file holds only {data} data bytes"
            )
        entries[key] = TensorEntry(key, file, dtype, shape)
    return entries


@dataclasses.dataclass
class CheckpointFiles:
    """Every tensor of a checkpoint directory, by key; ``config`` is its config.json, if any."""

    path: Path
    entries: dict[str, TensorEntry]
    config: Mapping[str, Any] | None

    @classmethod
    def open(cls, path: str | Path) -> CheckpointFiles:
        """Find and parse the headers of the checkpoint at ``path`` (a directory or a file)."""
        root = Path(path)
        if not root.exists():
            raise CheckpointNotFoundError(
                f"{root}: no such file or directory.\n"
                "Fix: pass the directory save_pretrained wrote (it holds model.safetensors or "
                "model.safetensors.index.json)."
            )
        if root.is_file():
            files, root = [root], root.parent
        elif (root / INDEX).is_file():
            files = _indexed(root / INDEX)
        elif (root / SINGLE).is_file():
            files = [root / SINGLE]
        else:
            found = sorted(p.name for p in root.iterdir())[:10]
            raise CheckpointNotFoundError(
                f"{root}: holds neither {SINGLE} nor {INDEX} (it has: {found}).\n"
                "Fix: pass the directory of a safetensors checkpoint; convert a .bin checkpoint "
                "with save_pretrained(..., safe_serialization=True) first."
            )
        entries: dict[str, TensorEntry] = {}
        for file in files:
            entries.update(_header(file))
        config = None
        if (root / "config.json").is_file():
            config = json.loads((root / "config.json").read_text())
        return cls(root, entries, config)

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)


def _indexed(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise _corrupt(index, f"it is not an index with a 'weight_map' ({e!r})") from None
    files = sorted(set(weight_map.values()))
    for name in files:
        if not (index.parent / name).is_file():
            keys = sorted(k for k, v in weight_map.items() if v == name)
            raise MissingShardFileError(
                f"{index.parent / name}: named by {index.name} for {len(keys)} tensors "
                f"({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}), but not there.\n"
                "Fix: copy every shard file the index lists into the checkpoint directory."
            )
    return [index.parent / name for name in files]


def read_slice(entry: TensorEntry, index: tuple[slice, ...]) -> torch.Tensor:
    """``entry[index]`` as a tensor of its own, on the CPU, reading only that slice's pages.

    safetensors' ``get_slice(...)[index]`` is a view into the memory-mapped file: only the
    pages under the slice are read, but the view keeps the mapping (and the pages it
    touched) alive. The copy is what the caller keeps; the file is closed right after, so
    the touched pages leave this process's memory with it, one tensor at a time.
    """
    # safetensors comes with the hf extra (transformers); ``import hp_core`` works without it.
    from safetensors import safe_open

    with safe_open(str(entry.file), "pt") as f:
        view = f.get_slice(entry.key)[index] if index else f.get_tensor(entry.key)
        return view.clone(memory_format=torch.contiguous_format)
