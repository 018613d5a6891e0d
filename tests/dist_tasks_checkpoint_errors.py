"""Rank-side tasks of the checked-load tests (importable by the spawned ranks).

One task runs every case on one gloo world (tp=2, production): it saves the checkpoints,
damages copies of them (rank 0 edits the files, both ranks wait), and for each case
records the error every rank raised and whether the model (and optimizer) kept every
value bit for bit.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import hp_core
from hp_core.checkpoint import dcp_checks
from hp_core.checkpoint.dcp_checksums import CHECKSUM_FILE
from hp_core.checkpoint.dcp_reader import CheckedReader
from hp_core.testing.families import build_family, family_batch

KEY = "model.layers.0.self_attn.q_proj.weight"


def _applied(seed: int, mesh: DeviceMesh, mode: str = "production", **config: Any) -> nn.Module:
    model = build_family("llama", seed=seed, **config)
    hp_core.apply(model, hp_core.plan(model, mesh), mesh, mode=mode)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    snap: dict[str, Any] = {f"p.{k}": _local(v) for k, v in model.named_parameters()}
    snap.update({f"b.{k}": _local(v) for k, v in model.named_buffers()})
    if opt is not None:
        for i, state in enumerate(opt.state.values()):
            snap.update({f"o.{i}.{k}": _local(v) for k, v in state.items()})
        snap["o.count"] = torch.tensor(len(opt.state))
    return snap


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if k in b)


def _attempt(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except hp_core.HpError as err:
        return f"{type(err).__name__}: {err}"
    return None


def _on_rank0(edit: Callable[[], Any]) -> None:
    if dist.get_rank() == 0:
        edit()
    dist.barrier()


def _copy(src: str, dst: str, *, checksums: bool = True) -> str:
    def edit() -> None:
        shutil.copytree(src, dst)
        if not checksums:
            os.remove(os.path.join(dst, CHECKSUM_FILE))

    _on_rank0(edit)
    return dst


def _item(root: str, fqn: str) -> tuple[str, int, int]:
    """(file, offset, length) of the first stored chunk of ``fqn``."""
    metadata = FileSystemReader(root).read_metadata()
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
    return os.path.join(root, info.relative_path), info.offset, info.length


def _overwrite(path: str, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def _files_read(root: str, model: nn.Module) -> set[str]:
    metadata = FileSystemReader(root).read_metadata()
    state = dict(model.state_dict())
    return {r.file for r in dcp_checks.planned_reads(metadata, state)}


def checked_loads(root: str) -> dict[str, Any]:
    """Every case of the checked load on one world; see tests/test_checkpoint_errors.py."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank = dist.get_rank()
    out: dict[str, Any] = {"rank": rank}
    batch = family_batch("llama", batch=2, seq=16)

    source = _applied(0, mesh)
    good = os.path.join(root, "good")
    hp_core.save_checkpoint(good, source, extra={"step": 3, "seed": torch.arange(4)})
    with torch.no_grad():
        source_logits = source(input_ids=batch, use_cache=False).logits.clone()
    expected = _snapshot(source)

    # The model every case loads into: other weights, and an optimizer that took a step.
    model = _applied(1, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=batch, use_cache=False).logits.square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    before = _snapshot(model, opt)
    out["initial_diff"] = _diff(before, expected)  # negative control of the round trip

    errors: dict[str, str | None] = {}
    unchanged: dict[str, bool] = {}

    def case(name: str, path: str, **kwargs: Any) -> None:
        errors[name] = _attempt(lambda: hp_core.load_checkpoint(path, model, **kwargs))
        unchanged[name] = _same(_snapshot(model, opt), before)

    # Another model: the tiny llama with a wider MLP (192 instead of 128), saved at tp=2.
    other = os.path.join(root, "wider")
    hp_core.save_checkpoint(other, _applied(0, mesh, intermediate_size=192))
    case("wider", other)
    # Another family at tp=2 (qwen2: llama's layout plus q/k/v biases).
    family = os.path.join(root, "qwen2")
    qwen2 = build_family("qwen2", seed=0)
    hp_core.apply(qwen2, hp_core.plan(qwen2, mesh), mesh)
    hp_core.save_checkpoint(family, qwen2)
    case("qwen2", family)
    # A checkpoint of one process (tp=1) of a llama with 127 tokens: DCP reshards any
    # layout, so what a tp=2 model cannot hold is a global shape; here the vocabulary's.
    odd = os.path.join(root, "vocab127")
    odd_model = build_family("llama", seed=0, vocab_size=127)
    _on_rank0(lambda: dcp.save(odd_model.state_dict(), checkpoint_id=odd, no_dist=True))
    case("vocab127", odd)
    # Missing and unexpected keys, a dtype, written with plain dcp.save.
    full = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in source.state_dict().items()
    }
    missing = os.path.join(root, "missing")
    dcp.save(
        {k: v for k, v in source.state_dict().items() if k != "model.norm.weight"},
        checkpoint_id=missing,
    )
    case("missing", missing)
    unexpected = os.path.join(root, "unexpected")
    dcp.save({**source.state_dict(), "lm_head.bias": torch.zeros(128)}, checkpoint_id=unexpected)
    case("unexpected", unexpected)
    dtype = os.path.join(root, "dtype")
    dcp.save({**source.state_dict(), KEY: full[KEY].double()}, checkpoint_id=dtype)
    case("dtype", dtype)
    # The optimizer's state is not in a model-only checkpoint.
    case("no_optimizer_state", good, optimizer=opt)

    # Damaged files.
    truncated = _copy(good, os.path.join(root, "truncated"))
    path, offset, length = _item(truncated, KEY)
    _on_rank0(lambda: os.truncate(path, offset + length // 2))
    out["truncated_file"] = os.path.basename(path)
    case("truncated", truncated)
    # The same with an optimizer: its state is as it was too.
    with_opt = os.path.join(root, "with_optimizer")
    hp_core.save_checkpoint(with_opt, model, opt)
    truncated_opt = _copy(with_opt, os.path.join(root, "truncated_with_optimizer"))
    path, offset, length = _item(truncated_opt, KEY)
    _on_rank0(lambda: os.truncate(path, offset + length // 2))
    case("truncated_with_optimizer", truncated_opt, optimizer=opt)
    deleted = _copy(good, os.path.join(root, "deleted"))
    path, _, _ = _item(deleted, KEY)
    _on_rank0(lambda: os.remove(path))
    out["deleted_file"] = os.path.basename(path)
    case("deleted", deleted)
    no_meta = _copy(good, os.path.join(root, "no_metadata"))
    _on_rank0(lambda: os.remove(os.path.join(no_meta, ".metadata")))
    case("no_metadata", no_meta)
    case("no_directory", os.path.join(root, "never_saved"))
    bad_meta = _copy(good, os.path.join(root, "bad_metadata"))
    _on_rank0(lambda: _overwrite(os.path.join(bad_meta, ".metadata"), 0, b"not a pickle"))
    case("metadata_checksum", bad_meta)
    bad_meta_plain = _copy(bad_meta, os.path.join(root, "bad_metadata_plain"), checksums=False)
    case("metadata_unpicklable", bad_meta_plain)
    bad_sums = _copy(good, os.path.join(root, "bad_checksums"))
    _on_rank0(lambda: _overwrite(os.path.join(bad_sums, CHECKSUM_FILE), 0, b"{{"))
    case("checksum_file", bad_sums)
    # A flipped byte inside a replicated tensor's raw values (found by searching the file).
    flipped = _copy(good, os.path.join(root, "flipped"))
    norm = "model.norm.weight"
    raw = expected[f"p.{norm}"].numpy().tobytes()
    path, offset, length = _item(flipped, norm)

    def flip() -> None:
        with open(path, "rb") as f:
            f.seek(offset)
            at = offset + f.read(length).index(raw) + len(raw) // 2
        _overwrite(path, at, bytes([raw[len(raw) // 2] ^ 0xFF]))

    _on_rank0(flip)
    case("flipped", flipped)
    # The same flip without the checksum file: DCP and torch.load cannot see it.
    flipped_plain = _copy(flipped, os.path.join(root, "flipped_plain"), checksums=False)
    # The end of a stored record overwritten: torch.load cannot read it.
    broken = _copy(good, os.path.join(root, "broken_record"), checksums=False)
    path, offset, length = _item(broken, KEY)
    _on_rank0(lambda: _overwrite(path, offset + length - 22, b"\0" * 22))
    case("broken_record", broken)

    # One rank fails, the other does not.
    #  (a) before the read: a file that only one rank reads is gone.
    reads = _gathered(_files_read(good, model))
    alone = sorted((f, r) for r in (0, 1) for f in reads[r] - reads[1 - r])
    out["read_by_one_rank"] = alone
    gone = _copy(good, os.path.join(root, "one_rank_file_gone"))
    _on_rank0(lambda: os.remove(os.path.join(gone, alone[0][0])))
    case("one_rank_file_gone", gone)
    #  (b) while reading: rank 1's reads fail (an I/O error), rank 0's succeed.
    original = CheckedReader._slice_file

    def failing(self: CheckedReader, file: Any, sinfo: Any) -> Any:
        original(self, file, sinfo)  # names the item it reads, then the disk "fails"
        raise OSError(errno.EIO, "Input/output error (injected)")

    if rank == 1:
        CheckedReader._slice_file = failing  # type: ignore[method-assign]
    try:
        case("rank1_read_fails", good)
        #  (c) the same with staging=False: rank 0 wrote its values in place.
        errors["in_place"] = _attempt(lambda: hp_core.load_checkpoint(good, model, staging=False))
        unchanged["in_place"] = _same(_snapshot(model, opt), before)
    finally:
        CheckedReader._slice_file = original  # type: ignore[method-assign]
    _restore(model, opt, before)

    # A fresh optimizer (no state yet) keeps no state a failed load made.
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    errors["fresh_optimizer"] = _attempt(
        lambda: hp_core.load_checkpoint(truncated_opt, model, optimizer=fresh)
    )
    out["fresh_state_after"] = len(fresh.state)

    # Successful loads last (they change the model).
    out["silent_flip"] = _attempt(lambda: hp_core.load_checkpoint(flipped_plain, model))
    out["silent_flip_diff"] = _diff(_snapshot(model), expected)
    out["lenient"] = _attempt(lambda: hp_core.load_checkpoint(unexpected, model, strict=False))
    out["lenient_diff"] = _diff(_snapshot(model), expected)
    _restore(model, opt, before)
    extra = hp_core.load_checkpoint(good, model)
    out["extra"] = {"step": extra["step"], "seed": extra["seed"].tolist()}
    out["round_trip_diff"] = _diff(_snapshot(model), expected)
    with torch.no_grad():
        logits = model(input_ids=batch, use_cache=False).logits
    out["logits_diff"] = float((logits - source_logits).abs().max())
    out["errors"], out["unchanged"] = errors, unchanged
    return out


def _gathered(value: Any) -> list[Any]:
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _restore(model: nn.Module, opt: torch.optim.Optimizer, snap: dict[str, Any]) -> None:
    """Put ``snap``'s values back into ``model`` and ``opt`` (after a case that changed them)."""
    with torch.no_grad():
        for k, v in model.named_parameters():
            (v.to_local() if isinstance(v, DTensor) else v).copy_(snap[f"p.{k}"])
        for i, state in enumerate(opt.state.values()):
            for k, v in state.items():
                (v.to_local() if isinstance(v, DTensor) else v).copy_(snap[f"o.{i}.{k}"])


def optimizer_round_trip(root: str) -> dict[str, Any]:
    """Validate mode (DTensor parameters and moments): model and AdamW state round-trip."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    batch = family_batch("llama", batch=2, seq=16)

    def stepped(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _applied(seed, mesh, mode="validate")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(input_ids=batch, use_cache=False).logits.square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return model, opt

    source, source_opt = stepped(0)
    hp_core.save_checkpoint(root, source, source_opt)
    expected = _snapshot(source, source_opt)
    model, opt = stepped(1)
    before = _diff(_snapshot(model, opt), expected)
    hp_core.load_checkpoint(root, model, opt)
    after = _snapshot(model, opt)
    return {
        "before": before,
        "after": _diff(after, expected),
        "keys": sorted(after) == sorted(expected),
    }
