"""What ``load_pretrained`` refuses: one error class per kind of bad checkpoint or model.

Each names the file and the key(s) and ends with a ``Fix:``; every check runs before the
model is touched, so a refused load leaves every rank's model exactly as it was. They
belong to the checkpoint family of ``dcp_errors`` too: a key, shape or dtype that does not
fit is a ``CheckpointMismatchError`` whichever loader found it, an absent file a
``CheckpointMissingFileError``, a damaged one a ``CheckpointCorruptError``.
"""

from __future__ import annotations

from hp_core.checkpoint.dcp_errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLoadError,
    CheckpointMismatchError,
    CheckpointMissingFileError,
)

__all__ = [
    "CheckpointDtypeError",
    "CheckpointKeysMissingError",
    "CheckpointModelMismatchError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointShapeError",
    "CheckpointUnexpectedKeysError",
    "CorruptSafetensorsError",
    "MissingShardFileError",
    "NotOnMetaError",
    "PretrainedLoadError",
]


class PretrainedLoadError(CheckpointError):
    """A pretrained checkpoint that cannot be loaded into this parallelized model."""


class CheckpointNotFoundError(PretrainedLoadError, CheckpointMissingFileError):
    """The checkpoint path does not exist or holds no safetensors file."""


class CorruptSafetensorsError(PretrainedLoadError, CheckpointCorruptError):
    """A safetensors file whose header does not parse or whose data is cut short."""


class MissingShardFileError(PretrainedLoadError, CheckpointMissingFileError):
    """``model.safetensors.index.json`` names a shard file that is not there."""


class CheckpointKeysMissingError(PretrainedLoadError, CheckpointMismatchError, KeyError):
    """Parameters or persistent buffers of the model that the checkpoint does not hold."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class CheckpointUnexpectedKeysError(PretrainedLoadError, CheckpointMismatchError, KeyError):
    """Checkpoint tensors that no parameter or buffer of the model takes."""

    def __str__(self) -> str:
        return str(self.args[0])


class CheckpointDtypeError(PretrainedLoadError, CheckpointMismatchError, TypeError):
    """A checkpoint tensor whose dtype differs from its parameter's (no silent cast)."""


class CheckpointShapeError(PretrainedLoadError, CheckpointMismatchError):
    """A checkpoint tensor whose shape differs from its parameter's global shape."""


class CheckpointModelMismatchError(PretrainedLoadError, CheckpointMismatchError):
    """A checkpoint saved from another model (another ``model_type``, or no common keys)."""


class CheckpointReadError(PretrainedLoadError, CheckpointLoadError, OSError):
    """Reading a checkpoint slice failed on some rank; no rank loaded anything."""


class NotOnMetaError(PretrainedLoadError):
    """A model that is not a meta-built, hp-applied model (or a validate-mode one FSDP2 wraps)."""
