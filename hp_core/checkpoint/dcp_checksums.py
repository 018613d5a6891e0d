"""Checksums of a DCP checkpoint's stored bytes: ``hp_checksums.json`` next to ``.metadata``.

DCP stores each tensor chunk as a ``torch.save`` record and ``torch.load`` does not check
the records' CRCs, so a flipped bit inside a tensor's bytes loads silently as a wrong
value. ``save_checkpoint`` therefore writes one CRC-32 per stored item (keyed by file,
offset and length, the fields of ``.metadata``'s storage records) plus one for
``.metadata`` itself; the checked reader verifies each item it reads, in the same pass
that reads it, so the check costs one CRC over the bytes this rank loads anyway.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

from hp_core.checkpoint.dcp_errors import CheckpointCorruptError

__all__ = [
    "CHECKSUM_FILE",
    "Checksums",
    "crc_of_file",
    "crc_of_items",
    "item_key",
    "read_checksums",
    "write_checksums",
]

CHECKSUM_FILE = "hp_checksums.json"
_BLOCK = 1 << 24  # hash in 16 MiB blocks: memory stays bounded for a large item


def item_key(relative_path: str, offset: int, length: int) -> str:
    """The key of one stored item in the checksum file."""
    return f"{relative_path}:{offset}:{length}"


def _crc_of_range(stream: Any, offset: int, length: int) -> int:
    stream.seek(offset)
    crc, left = 0, length
    while left > 0:
        block = stream.read(min(left, _BLOCK))
        if not block:
            break  # a short file: the CRC will not match, which is the point
        crc = zlib.crc32(block, crc)
        left -= len(block)
    return crc


def crc_of_file(path: str) -> int:
    """The CRC-32 of the whole file at ``path``."""
    with open(path, "rb") as stream:
        return _crc_of_range(stream, 0, os.path.getsize(path))


def crc_of_items(root: str, items: Iterable[tuple[str, int, int]]) -> dict[str, int]:
    """``item_key → CRC-32`` for each ``(relative_path, offset, length)`` of ``items``."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for relative_path, offset, length in items:
        by_file.setdefault(relative_path, []).append((offset, length))
    crcs = {}
    for relative_path, ranges in by_file.items():
        with open(os.path.join(root, relative_path), "rb") as stream:
            for offset, length in sorted(ranges):
                crcs[item_key(relative_path, offset, length)] = _crc_of_range(
                    stream, offset, length
                )
    return crcs


class Checksums:
    """The checksum file of one checkpoint, read back."""

    def __init__(self, path: str, metadata_crc: int, items: Mapping[str, int]) -> None:
        self.path = path
        self.metadata_crc = metadata_crc
        self.items = dict(items)

    def check_item(
        self, path: str, relative_path: str, offset: int, length: int, data: bytes, key: str
    ) -> None:
        """Raise ``CheckpointCorruptError`` when ``data`` is not what was saved there."""
        want = self.items.get(item_key(relative_path, offset, length))
        if want is None:
            raise CheckpointCorruptError(
                f"{path}: {key} is stored at bytes {offset}..{offset + length}, "
                f"but {self.path} has no checksum for that range.\n"
                ".metadata and the checksum file describe different checkpoints.\n"
                "Fix: copy the checkpoint directory again as a whole, or delete "
                f"{CHECKSUM_FILE} to load without checksums."
            )
        got = zlib.crc32(data)
        if got != want:
            raise CheckpointCorruptError(
                f"{path}: the bytes of {key} (at {offset}..{offset + length}) fail "
                f"their checksum (CRC-32 {got:08x}, saved {want:08x}).\n"
                "The file was changed or damaged after it was saved.\n"
                "Fix: restore the checkpoint from an intact copy, or resume from an earlier "
                "checkpoint."
            )


def write_checksums(root: str, metadata_crc: int, items: Mapping[str, int]) -> None:
    """Write the checksum file of the checkpoint at ``root`` (one process does it)."""
    document = {
        "algorithm": "crc32",
        "metadata": metadata_crc,
        "items": dict(sorted(items.items())),
    }
    target = os.path.join(root, CHECKSUM_FILE)
    with open(target + ".tmp", "w") as out:
        json.dump(document, out)
    os.replace(target + ".tmp", target)  # never a half-written checksum file


def read_checksums(root: str) -> Checksums | None:
    """The checkpoint's checksums, or None when it has none (saved by plain ``dcp.save``)."""
    path = os.path.join(root, CHECKSUM_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as stream:
            document = json.load(stream)
        items = {str(k): int(v) for k, v in document["items"].items()}
        return Checksums(path, int(document["metadata"]), items)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointCorruptError(
            f"{path}: unreadable ({type(err).__name__}: {err}).\n"
            "Fix: restore the checkpoint from an intact copy, or delete the file to load "
            "without checksums."
        ) from err
