"""A ``FileSystemReader`` whose failures name the file and the key: ``CheckedReader``.

DCP's reader opens each storage file and hands ``torch.load`` a view of each stored item.
When that fails (an unpicklable record, a short file, a vanished file) its error names
neither. ``CheckedReader`` reads each item's bytes itself, remembers which item it is
reading, verifies the item's checksum when the checkpoint has them, and turns a failure
into a ``Checkpoint*Error`` naming the file, the key and the byte range. The hook is
``_slice_file``, the reader's one place where an item's file and range meet.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from hp_core.checkpoint.dcp_checksums import Checksums
from hp_core.checkpoint.dcp_errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLoadError,
    CheckpointMissingFileError,
)

__all__ = ["CheckedReader"]

_UNREADABLE = (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, AssertionError)


class CheckedReader(FileSystemReader):
    """Read a DCP checkpoint; every failure names the file and the key it was reading."""

    def __init__(self, root: str, checksums: Checksums | None) -> None:
        super().__init__(root)
        self.root = root
        self.checksums = checksums
        self._keys: dict[tuple[str, int], str] = {}
        self._reading = root

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._keys = {
            (info.relative_path, info.offset): index.fqn
            for index, info in (metadata.storage_data or {}).items()
        }

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        key = self._keys.get((sinfo.relative_path, sinfo.offset), "an item")
        path = os.path.join(self.root, sinfo.relative_path)
        self._reading = f"{path}: {key} (bytes {sinfo.offset}..{sinfo.offset + sinfo.length})"
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        if len(data) != sinfo.length:
            raise CheckpointCorruptError(
                f"{self._reading}: the file ends after {len(data)} of the item's bytes "
                "(truncated).\nFix: copy the checkpoint again from an intact source."
            )
        if self.checksums is not None:
            self.checksums.check_item(
                path, sinfo.relative_path, sinfo.offset, sinfo.length, data, key
            )
        return io.BytesIO(data)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return super().read_data(plan, planner)
        except CheckpointError:
            raise
        except torch.OutOfMemoryError:
            raise  # not the checkpoint's fault: the caller sees torch's own error
        except FileNotFoundError as err:
            raise CheckpointMissingFileError(
                f"{err.filename}: vanished while the checkpoint was read ({err.strerror}).\n"
                "Fix: do not move or delete a checkpoint while it loads; copy it whole again."
            ) from err
        except _UNREADABLE as err:
            raise CheckpointCorruptError(
                f"{self._reading}: unreadable ({type(err).__name__}: {err}).\n"
                "Fix: restore the checkpoint from an intact copy, or resume from an earlier "
                "checkpoint."
            ) from err
        except Exception as err:
            raise CheckpointLoadError(
                f"{self._reading}: reading failed ({type(err).__name__}: {err}).\n"
                f"Fix: check that {self.root} is readable from this rank (permissions, the "
                "file system's health), then load again."
            ) from err
