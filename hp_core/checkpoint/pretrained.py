"""Load a Hugging Face safetensors checkpoint into a meta-built, hp-applied model.

``load_pretrained(model, path)`` is for a model built on the meta device, planned and
applied: hp's apply only chunks meta parameters, so nothing of the model has memory yet.
It then

1. parses every header of the checkpoint and checks it against the model (missing and
   unexpected keys, dtypes, shapes against each parameter's *global* shape, the model
   type), raising before anything is read; every rank checks the same headers, so every
   rank raises the same error;
2. reads, on each rank, only the slices the rank owns: a sharded parameter's local
   range through safetensors' lazy slicing, routed experts only for the rank's experts;
   replicated parameters and buffers whole;
3. agrees across the mesh (one small all-reduce per mesh dim, ``dcp_agree.any_failed``)
   that every rank read everything; only then
4. commits: each parameter object gets its values in place (``torch.utils.swap_tensors``,
   so every hook, journal entry and gradient reduction that holds the parameter still
   holds it; tied parameters are one object and stay tied), persistent buffers are set and
   non-persistent ones recomputed (``hp_core.checkpoint.buffers``).

A failed load leaves every rank's model as it was: still on meta. Dtypes are never cast
silently: a checkpoint tensor of another dtype is refused unless ``cast=True``.

FSDP2 may come before or after. After (``apply`` → ``load_pretrained`` → ``fully_shard``),
every rank holds hp's whole shard until FSDP splits it over dp. Before (``apply`` →
``fully_shard`` on meta → ``load_pretrained``, torchtitan's order), each parameter is FSDP's
DTensor over dp of hp's shard, and each rank reads only FSDP's piece of it: hp's shard
offset plus FSDP's inside it (``hp_core.runtime.fsdp_views.fsdp_box``), a dp-th of the
memory. The commit hands each value to FSDP2 through ``nn.Module._apply`` (what
``to_empty`` uses), whose FSDP2 override adopts it as FSDP's sharded storage. Validate mode
under FSDP2 is refused (its 2-D DTensors carry no record of which mesh dims are FSDP's).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hp_core.checkpoint.buffers import non_persistent_buffers, recompute_buffers
from hp_core.checkpoint.dcp_agree import any_failed
from hp_core.checkpoint.key_map import Source, map_keys
from hp_core.checkpoint.pretrained_errors import (
    CheckpointDtypeError,
    CheckpointKeysMissingError,
    CheckpointModelMismatchError,
    CheckpointReadError,
    CheckpointShapeError,
    CheckpointUnexpectedKeysError,
    NotOnMetaError,
)
from hp_core.checkpoint.safetensors_files import CheckpointFiles
from hp_core.checkpoint.slices import (
    Ranges,
    local_ranges,
    plain_placements,
    read_fused_local,
    read_local,
)
from hp_core.runtime.applied import AppliedModel, applied, applied_module
from hp_core.runtime.fsdp_views import fsdp_box
from hp_core.runtime.fused import FusedShards
from hp_core.runtime.param_layout import ParamLayout
from hp_core.runtime.state_views import saved_view

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["load_pretrained"]

CAP = 10  # keys listed in a message


@dataclasses.dataclass
class _Target:
    """One model tensor to fill: a parameter (all its tied names) or a persistent buffer."""

    names: list[str]
    tensor: torch.Tensor  # the meta parameter (or buffer) itself
    layout: ParamLayout | None  # None: replicated, read whole
    owner: nn.Module | None = None  # for a buffer: where it lives
    attr: str = ""
    fsdp: bool = False  # FSDP2's DTensor over dp: ``ranges`` is its local piece
    ranges: Ranges | None = None  # None: the layout's local ranges

    @property
    def shape(self) -> tuple[int, ...]:
        if self.layout is not None:
            return tuple(self.layout.shape)
        return tuple(self.tensor.shape)

    def local_ranges(self) -> Ranges:
        return self.ranges if self.ranges is not None else local_ranges(self.shape, self.layout)

    def describe(self) -> str:
        return self.layout.describe() if self.layout is not None else f"{self.shape} replicated"


def _listed(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - CAP} more" if len(keys) > CAP else ""
    return ", ".join(keys[:CAP]) + more


def _refuse_model(model: nn.Module, state: AppliedModel) -> bool:
    """Refuse what cannot be loaded; whether FSDP2 wraps (part of) the model."""
    fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
    if fsdp and state.mode != "production":
        raise NotOnMetaError(
            f"{type(model).__name__}: FSDP2 (fully_shard) already wraps this {state.mode}-mode "
            "model; its parameters are FSDP's 2-D DTensors, which do not say which mesh dims "
            "are FSDP's, so load_pretrained cannot tell which slice this rank owns.\n"
            "Fix: in validate mode call load_pretrained after hp_core.apply and before "
            "fully_shard (production mode loads either way)."
        )
    real = [
        n
        for n, p in model.named_parameters()
        if not (p.to_local() if isinstance(p, DTensor) else p).is_meta
    ]
    if real:
        raise NotOnMetaError(
            f"{type(model).__name__}: load_pretrained fills a model built on the meta device, "
            f"but {len(real)} parameters hold memory already ({_listed(real)}).\n"
            'Fix: build the model under `with torch.device("meta"):` '
            "(AutoModelForCausalLM.from_config), then plan and apply it; or use "
            "model.load_state_dict on a materialised model."
        )
    return fsdp


def _targets(
    model: nn.Module,
    layouts: Mapping[str, ParamLayout],
    fsdp: bool,
    fused_names: Mapping[str, FusedShards],
) -> list[_Target]:
    by_id: dict[int, _Target] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in by_id:
            by_id[id(p)].names.append(name)
            continue
        layout = layouts.get(name)
        if isinstance(p, DTensor) and fsdp:  # FSDP2's DTensor over dp of hp's shard
            shape, offset = fsdp_box(name, p, layout)
            ranges = tuple((o, o + n) for o, n in zip(offset, shape, strict=True))
            by_id[id(p)] = _Target([name], p, layout, fsdp=True, ranges=ranges)
            continue
        if isinstance(p, DTensor):  # validate: the parameter is its own layout
            layout = ParamLayout(
                p.device_mesh, tuple(p.placements), p.shape, p.stride(), fused_names.get(name)
            )
        by_id[id(p)] = _Target([name], p, layout)
    volatile = {n for n, *_ in non_persistent_buffers(model)}
    for prefix, module in model.named_modules():
        for attr, b in module._buffers.items():
            name = f"{prefix}.{attr}" if prefix else attr
            if b is not None and name not in volatile and id(b) not in by_id:
                by_id[id(b)] = _Target([name], b, None, module, attr)
    return list(by_id.values())


def _check(
    model: nn.Module, files: CheckpointFiles, targets: list[_Target], cast: bool
) -> dict[int, Source]:
    """Every check, on headers only; ``id(target tensor) → source``."""
    where = files.path
    theirs = (files.config or {}).get("model_type")
    ours = getattr(getattr(model, "config", None), "model_type", None)
    if theirs is not None and ours is not None and theirs != ours:
        raise CheckpointModelMismatchError(
            f"{where}: a checkpoint of a {theirs!r} model (config.json), but the model is "
            f"{type(model).__name__} ({ours!r}).\n"
            "Fix: pass the checkpoint of this model, or build the model from that checkpoint's "
            "config (AutoConfig.from_pretrained(path))."
        )
    names = [n for t in targets for n in t.names]
    sources, unused = map_keys(model, files.entries, names)
    volatile = {n for n, *_ in non_persistent_buffers(model)}
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    unused = [
        k for k in unused if not {k, f"{prefix}.{k}", k.removeprefix(f"{prefix}.")} & volatile
    ]
    found = {
        id(t.tensor): next((sources[n] for n in t.names if n in sources), None) for t in targets
    }
    missing = [t.names[0] for t in targets if found[id(t.tensor)] is None]
    if missing and len(missing) * 2 > len(targets):
        raise CheckpointModelMismatchError(
            f"{where}: the checkpoint holds {len(targets) - len(missing)} of the "
            f"{len(targets)} tensors of {type(model).__name__} (missing e.g. {_listed(missing)}; "
            f"it has e.g. {_listed(list(files.entries)[:CAP])}): a checkpoint of another model.\n"
            "Fix: pass the checkpoint saved from this model's architecture."
        )
    if missing:
        raise CheckpointKeysMissingError(
            f"{where}: no tensor for {len(missing)} model keys: {_listed(missing)}.\n"
            "Fix: load a checkpoint saved from this model's configuration (a different number "
            "of layers or a head the checkpoint lacks shows up here)."
        )
    if unused:
        raise CheckpointUnexpectedKeysError(
            f"{where}: {len(unused)} checkpoint tensors match no parameter or buffer of "
            f"{type(model).__name__}: {_listed(unused)}.\n"
            "Fix: build the model from the checkpoint's own config (AutoConfig.from_pretrained), "
            "or drop those tensors from the checkpoint."
        )
    out = {key: source for key, source in found.items() if source is not None}  # all, here
    for t in targets:
        _check_one(where, t, out[id(t.tensor)], cast)
    return out


def _check_one(where: Path, t: _Target, source: Source, cast: bool) -> None:
    files = sorted({str(p.entry.file.name) for p in source.pieces})
    # Stacked experts: every expert needs the same pieces (one missing leaves a hole).
    stacked = [p for p in source.pieces if p.expert is not None]
    # Counted in one pass (dim 0 of a plain tensor is its rows: a vocabulary of 32000).
    per_expert = [0] * (source.shape[0] if stacked else 0)
    for e in (p.expert for p in stacked if p.expert is not None):
        per_expert[e] += 1
    most = max(per_expert, default=0)
    lacking = [e for e, n in enumerate(per_expert) if n < most]
    if lacking or len({p.entry.shape for p in stacked}) > 1:
        raise CheckpointShapeError(
            f"{where / files[0]}: {source.describe()} for the model's {t.names[0]} do not "
            f"stack: experts {lacking} have fewer tensors than the others "
            f"({most}), or the experts' shapes differ "
            f"({sorted({p.entry.shape for p in stacked})}).\n"
            "Fix: load a complete checkpoint: every expert with every projection, all of one "
            "shape."
        )
    if source.shape != t.shape:
        raise CheckpointShapeError(
            f"{where / files[0]}: {source.describe()} makes a tensor of shape {source.shape}, but "
            f"the model's {t.names[0]} is {t.describe()} (global shape {t.shape}).\n"
            "Fix: load a checkpoint of this model's configuration (hidden size, heads, experts "
            "and vocabulary as in its config.json)."
        )
    dtype = source.pieces[0].entry.dtype
    if any(p.entry.dtype != t.tensor.dtype for p in source.pieces) and not cast:
        raise CheckpointDtypeError(
            f"{where / files[0]}: {source.describe()} is {dtype}, but the model's "
            f"{t.names[0]} is {t.tensor.dtype}; load_pretrained does not cast silently.\n"
            f"Fix: build the model in {dtype} (from_config(cfg, dtype={dtype})), or pass "
            "cast=True to cast every value to its parameter's dtype."
        )
    if t.layout is not None and not plain_placements(t.layout):
        raise NotOnMetaError(
            f"{t.names[0]}: its layout {t.describe()} is not made of shard and replicate "
            "placements only, which load_pretrained reads.\n"
            "Fix: call load_pretrained right after hp_core.apply, before wrapping the model."
        )


def _device(mesh: DeviceMesh) -> torch.device:
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


def _meshes(state: AppliedModel, targets: list[_Target]) -> list[DeviceMesh]:
    """hp's mesh, and FSDP2's dp meshes where hp's does not hold them: the ranks that must
    agree (every rank that holds a piece of any parameter)."""
    out = [state.mesh]
    for t in targets:
        mesh = t.tensor.device_mesh if isinstance(t.tensor, DTensor) else None
        if mesh is not None and t.fsdp and all(mesh != m for m in out):
            names = set(mesh.mesh_dim_names or ())
            if not (names and names <= set(state.mesh.mesh_dim_names or ())):
                out.append(mesh)
    return out


def _value(t: _Target, local: torch.Tensor) -> torch.Tensor:
    """What the parameter holds: a validate DTensor's view over ``local``, or ``local``."""
    if isinstance(t.tensor, DTensor) and t.layout is not None:
        # The shard of the re-arranged tensor (a fused projection) is viewed as it is.
        return saved_view(local, dataclasses.replace(t.layout, fused=None))
    return local


def _materialise_fsdp(
    root: nn.Module, targets: list[_Target], values: dict[int, torch.Tensor], device: torch.device
) -> None:
    """Give every parameter of an FSDP2-wrapped model its value, through FSDP2's own path.

    ``nn.Module._apply`` (what ``to_empty`` calls) swaps each parameter's contents in place
    (the objects stay), and FSDP2's ``_apply`` then calls ``reset_sharded_param``, which
    takes the new local tensor as its sharded storage (a padded copy only where FSDP pads
    an uneven dim 0). So the read values become FSDP's storage without a second copy of the
    model. Buffers get empty tensors here; the caller sets them.
    """
    new: dict[int, torch.Tensor] = {}
    for t in targets:
        if t.owner is not None:
            continue
        p, local = t.tensor, values.pop(id(t.tensor)).contiguous()
        new[id(p)] = (
            DTensor.from_local(
                local,
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
            if isinstance(p, DTensor)
            else local
        )

    def value(tensor: torch.Tensor) -> torch.Tensor:
        found = new.get(id(tensor))  # a tied parameter is visited once per module
        return found if found is not None else torch.empty_like(tensor, device=device)

    root._apply(value)


def load_pretrained(
    model: nn.Module, path: str | os.PathLike[str], *, cast: bool = False
) -> nn.Module:
    """Fill the meta-built, hp-applied ``model`` from the safetensors checkpoint at ``path``.

    ``path`` is a directory with ``model.safetensors`` or ``model.safetensors.index.json``
    and its shards (what ``save_pretrained`` writes). Each rank reads only its own slices.
    ``cast=True`` casts checkpoint values to each parameter's dtype (otherwise a dtype
    difference is refused). Returns ``model``, materialised on the mesh's device.
    """
    state = applied(model)
    if state is None:
        raise NotOnMetaError(
            f"{type(model).__name__}: not a model hp_core.apply parallelized, so there are no "
            "layouts saying which slices this rank owns.\n"
            "Fix: build on meta, then hp_core.plan and hp_core.apply, then load_pretrained."
        )
    root = applied_module(model)
    fsdp = _refuse_model(root, state)
    files = CheckpointFiles.open(Path(path))
    targets = _targets(root, state.layouts, fsdp, state.fused)
    sources = _check(root, files, targets, cast)
    device = _device(state.mesh)
    shapes = {id(t.tensor): torch.Size(t.shape) for t in targets}
    buffers, unset = recompute_buffers(root, device, shapes)  # the same on every rank
    if unset:
        raise CheckpointKeysMissingError(
            f"{files.path}: the non-persistent buffers {_listed(unset)} are in no "
            f"checkpoint and {type(root).__name__}._init_weights does not recompute them.\n"
            "Fix: give the owning module an _init_weights branch that computes them, or load "
            "into a materialised model with load_state_dict and set them yourself."
        )
    values: dict[int, torch.Tensor] = {}
    error: Exception | None = None
    try:
        for t in targets:
            # A re-arranged fused projection: its ranges (FSDP2's piece too) are positions in
            # the re-arranged tensor, each part's rows read on their own.
            fused = t.layout.fused if t.layout is not None else None
            local = (
                read_fused_local(sources[id(t.tensor)], t.local_ranges(), fused)
                if fused is not None
                else read_local(sources[id(t.tensor)], t.local_ranges())
            )
            values[id(t.tensor)] = local.to(device=device, dtype=t.tensor.dtype)
    except Exception as e:  # any failure here must reach the agreement, or the others hang
        error = e
    meshes = _meshes(state, targets) if dist.is_initialized() else []
    groups = [mesh.get_group(d) for mesh in meshes for d in range(mesh.ndim)]
    if any_failed(error is not None, device, groups):
        raise CheckpointReadError(
            f"{files.path}: reading the checkpoint failed on "
            f"{'this rank' if error is not None else 'another rank'}"
            f"{f' ({type(error).__name__}: {error})' if error is not None else ''}; "
            "no rank loaded anything and the model is still on meta.\n"
            "Fix: check that every rank can read every file of the checkpoint, then retry."
        ) from error
    # Commit: nothing below reads or communicates.
    with torch.no_grad():
        if fsdp:
            _materialise_fsdp(root, targets, values, device)
        for t in targets:
            if fsdp and t.owner is None:
                continue  # materialised above
            value = _value(t, values.pop(id(t.tensor)))
            if t.owner is not None:
                t.owner._buffers[t.attr] = value
                continue
            new = nn.Parameter(value, requires_grad=t.tensor.requires_grad)
            new.__dict__.update(t.tensor.__dict__)  # attributes others set on the parameter
            torch.utils.swap_tensors(t.tensor, new)
        for owner, attr, value in buffers.values():
            owner._buffers[attr] = value
    return model
