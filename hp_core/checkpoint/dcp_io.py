"""Checked save and load of an hp model (and its optimizer) with torch.distributed.checkpoint.

``save_checkpoint`` is ``dcp.save`` of torch's own ``get_model_state_dict`` (and
``get_optimizer_state_dict``), plus a checksum file. ``load_checkpoint`` refuses a
checkpoint before it touches the model: it reads ``.metadata``, checks that every key of
the model is there with its global shape and dtype (``dcp_checks``), that the files this
rank reads exist and are long enough, and that all ranks agree. It then loads into
*staging* copies (fresh tensors and DTensors of the model's layouts, not the model's own
views), verifying each item's checksum as it reads it, agrees again, and only then copies
the staged values into the model and the optimizer. A failure on any rank therefore
leaves every rank's model and optimizer exactly as they were.

Staging costs one extra copy of this rank's shard of the model (and of the optimizer
state) for the duration of the call. ``staging=False`` loads in place after the same
checks: then a failure found while reading (a corrupt item, a checksum mismatch, another
rank's read failing) leaves the model partly loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from hp_core.checkpoint.dcp_agree import agree, unwrap
from hp_core.checkpoint.dcp_checks import (
    check_files,
    check_fit,
    flat_target,
    planned_reads,
    read_metadata,
)
from hp_core.checkpoint.dcp_checksums import (
    CHECKSUM_FILE,
    crc_of_file,
    crc_of_items,
    read_checksums,
    write_checksums,
)
from hp_core.checkpoint.dcp_errors import (
    CheckpointError,
    CheckpointLoadError,
    CheckpointMismatchError,
)
from hp_core.checkpoint.dcp_reader import CheckedReader

__all__ = ["load_checkpoint", "save_checkpoint"]

OPTIMIZER = "optimizer"  # the optimizer state is saved under this top-level key
EXTRA = "extra"  # and the caller's extra objects under this one


def _rank() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.to_local().device if isinstance(tensor, DTensor) else tensor.device
    return torch.get_default_device()


def _container(value: Any) -> bool:
    """Whether DCP would flatten ``value`` into keys of its own (a nested ``extra``)."""
    if isinstance(value, Mapping):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    checksums: bool = True,
) -> None:
    """Save ``model`` (and ``optimizer``, and ``extra``: names to tensors or picklable
    objects) to the DCP checkpoint directory ``path``; every rank calls it.

    The model's keys are the checkpoint's top-level keys (as with
    ``dcp.save(model.state_dict())``), the optimizer's go under ``optimizer.``, ``extra``
    under ``extra.``. With ``checksums`` a CRC-32 of every stored item is written to
    ``hp_checksums.json``, which ``load_checkpoint`` verifies.
    """
    root = os.fspath(path)
    state: dict[str, Any] = dict(get_model_state_dict(model))
    clash = sorted(k for k in state if k.split(".")[0] in (OPTIMIZER, EXTRA))
    if clash:
        raise CheckpointMismatchError(
            f"{clash[0]}: a model key under {OPTIMIZER!r} or {EXTRA!r}, the names "
            "save_checkpoint keeps for the optimizer state and the extra objects.\n"
            f"Fix: save this model with dcp.save directly (into {root})."
        )
    nested = sorted(k for k, v in (extra or {}).items() if _container(v))
    if nested:
        raise CheckpointMismatchError(
            f"extra[{nested[0]!r}]: a mapping or a sequence of tensors; extra holds names "
            "to tensors or picklable objects, one level deep.\n"
            f"Fix: flatten it (e.g. extra={{'{nested[0]}.x': ...}})."
        )
    if optimizer is not None:
        state[OPTIMIZER] = get_optimizer_state_dict(model, optimizer)
    if extra:
        state[EXTRA] = dict(extra)
    stale = os.path.join(root, CHECKSUM_FILE)
    if _rank()[0] == 0 and os.path.exists(stale):
        os.remove(stale)  # an older save's checksums would refuse this one's bytes
    dcp.save(state, checkpoint_id=root, no_dist=not dist.is_initialized())
    if checksums:
        _write_checksums(root)


def _write_checksums(root: str) -> None:
    """Each rank hashes a share of the storage files; rank 0 writes the checksum file."""
    rank, world = _rank()
    metadata = FileSystemReader(root).read_metadata()
    items = sorted({(i.relative_path, i.offset, i.length) for i in metadata.storage_data.values()})
    files = sorted({item[0] for item in items})
    mine = set(files[rank::world])
    crcs = crc_of_items(root, [item for item in items if item[0] in mine])
    shares: list[dict[str, int] | None] = [crcs]
    if world > 1:
        shares = [None] * world
        dist.all_gather_object(shares, crcs)
    if rank == 0:
        merged = {k: v for share in shares for k, v in (share or {}).items()}
        write_checksums(root, crc_of_file(os.path.join(root, ".metadata")), merged)
    if world > 1:
        dist.barrier()  # a load right after the save finds the checksum file


def _staged(value: Any) -> Any:
    """A fresh tensor (or DTensor of the same layout) for ``value``; containers recurse."""
    if isinstance(value, DTensor):
        return DTensor.from_local(
            torch.empty_like(value.to_local()),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if isinstance(value, dict):
        return {k: _staged(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_staged(v) for v in value]
    return value


def _extra_target(metadata: Metadata, device: torch.device) -> dict[str, Any]:
    """Placeholders for the extra objects the checkpoint holds (DCP fills them)."""
    target: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(EXTRA + "."):
            name = key[len(EXTRA) + 1 :]
            if isinstance(md, TensorStorageMetadata):
                target[name] = torch.empty(md.size, dtype=md.properties.dtype, device=device)
            else:
                target[name] = None
    return target


def _preflight(
    root: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strict: bool,
    staging: bool,
) -> tuple[dict[str, Any], CheckedReader]:
    """What ``dcp.load`` fills and the reader it uses, after every check passed."""
    checksums = read_checksums(root)
    metadata = read_metadata(root, checksums)
    target: dict[str, Any] = dict(get_model_state_dict(model))
    if optimizer is not None:
        target[OPTIMIZER] = get_optimizer_state_dict(model, optimizer)
    if staging:
        target = _staged(target)
    ignored = [EXTRA + "."] + ([] if optimizer is not None else [OPTIMIZER + "."])
    check_fit(root, metadata, flat_target(target), strict=strict, ignored_prefixes=ignored)
    target[EXTRA] = _extra_target(metadata, _device(model))
    check_files(root, planned_reads(metadata, target), _rank()[0])
    return target, CheckedReader(root, checksums)


def _failed(root: str, stage: str, err: Exception) -> CheckpointError:
    problem = CheckpointLoadError(
        f"{root}: {stage} failed ({type(err).__name__}: {err}).\n"
        "Fix: remove the chained cause (its traceback is above), then load again."
    )
    problem.__cause__ = err
    return problem


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    staging: bool = True,
) -> dict[str, Any]:
    """Load the DCP checkpoint at ``path`` into ``model`` (and ``optimizer``); every rank
    calls it. Returns the ``extra`` objects saved with it (an empty dict when none).

    Any mesh and plan of the same model loads it (DCP reshards). Every refusal is a
    ``CheckpointError`` subclass raised on every rank, and leaves every rank's model and
    optimizer as they were (with ``staging=False``: only refusals before the read).
    ``strict=False`` ignores checkpoint keys the model does not have; a key the model has
    and the checkpoint lacks is always an error. Optimizer keys are ignored when
    ``optimizer`` is None.
    """
    root = os.fspath(path)
    device = _device(model)
    fresh = optimizer is not None and not optimizer.state
    try:
        return _load(root, model, optimizer, strict, staging, device)
    except BaseException:
        if optimizer is not None and fresh:
            optimizer.state.clear()  # torch's get_optimizer_state_dict initialised it
        raise


def _load(
    root: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strict: bool,
    staging: bool,
    device: torch.device,
) -> dict[str, Any]:
    problem: CheckpointError | None = None
    target: dict[str, Any] = {}
    reader = CheckedReader(root, None)
    try:
        target, reader = _preflight(root, model, optimizer, strict, staging)
    except CheckpointError as err:
        problem = err
    except Exception as err:
        problem = _failed(root, "the checks before loading", err)
    agree(problem, device)  # a rank whose checks failed stops every rank, nothing read yet
    try:
        dcp.load(target, storage_reader=reader, no_dist=not dist.is_initialized())
    except CheckpointException as exc:  # DCP gathered every rank's failure
        problem = unwrap(exc.failures, root)
        if problem.__cause__ is None:
            problem.__cause__ = exc  # DCP's message holds every failing rank's traceback
    except CheckpointError as err:  # one process: the reader's error as it is
        problem = err
    except Exception as err:
        problem = _failed(root, "reading", err)
    agree(problem, device)
    extra = target.pop(EXTRA)
    optimizer_state = target.pop(OPTIMIZER, None)
    set_model_state_dict(model, target)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state)
    return dict(extra)
