"""The errors of a checked checkpoint load or save (``hp_core.checkpoint.dcp_io``).

Each names the file and, where there is one, the key; each ends with ``Fix: ...``. A load
that raises any of them has left the model and the optimizer as they were, on every rank:
the checks run before anything is read into the model, and the values are read into
staging copies first. When only some ranks fail, the others raise the same class with the
failing rank's message, prefixed with ``rank N:``.
"""

from __future__ import annotations

from hp_core.errors import HpError

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointLoadError",
    "CheckpointMismatchError",
    "CheckpointMissingFileError",
    "error_class",
]


class CheckpointError(HpError, RuntimeError):
    """The base of every refusal of ``load_checkpoint`` / ``save_checkpoint``."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not hold this model: a key missing or unexpected, a global shape
    or a dtype that differs."""


class CheckpointMissingFileError(CheckpointError, FileNotFoundError):
    """A file the load needs (``.metadata`` or a storage file this rank reads) is absent."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """A file is there but unreadable: truncated, unpicklable, or failing its checksum."""


class CheckpointLoadError(CheckpointError):
    """The load failed for a reason none of the other classes describes (the cause is
    chained and named in the message)."""


_CLASSES: dict[str, type[CheckpointError]] = {
    cls.__name__: cls
    for cls in (
        CheckpointError,
        CheckpointMismatchError,
        CheckpointMissingFileError,
        CheckpointCorruptError,
        CheckpointLoadError,
    )
}


def error_class(name: str) -> type[CheckpointError]:
    """The checkpoint error class called ``name`` (``CheckpointLoadError`` for any other)."""
    return _CLASSES.get(name, CheckpointLoadError)
