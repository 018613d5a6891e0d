"""Fused projections: how their parts sit along the fused dim, and how tp splits them whole.

A fused projection (``qkv_proj``, ``query_key_value``, ``c_attn``, ``Wqkv``,
``gate_up_proj``) computes several projections in one matmul; the module's forward then
splits the output. ``FusedLayout`` records how: the fused dim of the parameter (rows of an
``nn.Linear`` weight, columns of a GPT-2 ``Conv1D`` weight, a bias's only dim), the sizes of
the parts along it in order, and how many whole units (heads, kv groups, rows) each holds.

On tp each rank must hold whole units of *every* part. A layout of one part (per-head
interleaved ``[q k v]`` heads, falcon's per-kv-group ``[q.. q k v]``) is already split right
by contiguous ``Shard``: its ``index`` is None. A layout of several parts (concatenated
``[Q; K; V]``, ``[gate; up]``) is re-arranged first: ``index(tp)`` orders the fused dim as
``[Q_0 K_0 V_0 | Q_1 K_1 V_1 | ...]``, so rank r's contiguous shard is its rows of each part.

``derive`` reads the layout off the model (its config: head counts, head_dim, intermediate
size; its family's way of splitting the output) and refuses, naming the module, the layout,
the counts and the fix, what tp cannot split into whole units. A fused q/k/v whose head
count neither the module nor its config gives (or whose guessed kv count does not add up)
is left to the proof, with its units unknown (0): ``hp_core.planner.fused_proof`` reads them
off the forward's views into heads, or refuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Shard

from hp_core.mesh import MeshSpec
from hp_core.planner.lints import FusedProjectionError, is_conv1d
from hp_core.planner.templates.roles import Role
from hp_core.plans.fixes import keep_whole_proposal
from hp_core.plans.proposal import propose
from hp_core.spec.module_spec import ModuleShardingSpec

__all__ = ["FusedLayout", "derive", "fused_layouts", "is_conv1d", "local_region"]

#: Families whose fused qkv the forward views as ``(..., heads, 3 * head_dim)``: a hint of
#: the kind to try first; ``hp_core.planner.fused_proof`` reads the layout off the forward.
_INTERLEAVED = frozenset({"gpt_neox", "bloom", "persimmon", "stablelm_epoch"})
KINDS = ("concatenated", "interleaved", "grouped", "gate_up")


@dataclasses.dataclass(frozen=True)
class FusedLayout:
    """The parts of one fused parameter along its fused dim (see the module docstring)."""

    kind: str
    dim: int
    parts: tuple[int, ...]
    units: tuple[int, ...]
    names: tuple[str, ...]

    def size(self) -> int:
        return sum(self.parts)

    def describe(self) -> str:
        body = ", ".join(
            f"{n} {p} ({u} unit{'s' if u != 1 else ''})"
            for n, p, u in zip(self.names, self.parts, self.units, strict=True)
        )
        return f"{self.kind} along dim {self.dim}: [{body}]"

    def check(self, where: str, shape: tuple[int, ...], tp: int) -> None:
        """Refuse a layout that does not describe ``shape`` or that ``tp`` cannot split whole."""
        if self.dim >= len(shape) or shape[self.dim] != self.size():
            raise FusedProjectionError(
                f"{where}: the fused layout {self.describe()} sums to {self.size()}, but the "
                f"parameter has shape {tuple(shape)}.\nFix: re-plan the model (the layout is "
                "derived from it) instead of editing the plan's fused_layouts."
            )
        for name, part, units in zip(self.names, self.parts, self.units, strict=True):
            if units <= 0 or part % units or units % tp:
                mqa = " (multi-query: one key/value head is shared by all)" if units == 1 else ""
                raise FusedProjectionError(
                    f"{where}: {self.describe()}: part {name!r} has {units} whole unit(s){mqa}, "
                    f"which tp={tp} cannot split; each rank must hold whole heads of every part.\n"
                    f"Fix: choose a tp size that divides {units}, or keep the boundary whole "
                    "on tp (an override replicating its parameters, output replicated)."
                )

    def index(self, tp: int) -> torch.Tensor | None:
        """Positions along the fused dim in re-arranged order, or None (no re-arrangement)."""
        if len(self.parts) == 1 or tp <= 1:
            return None
        starts = [sum(self.parts[:i]) for i in range(len(self.parts))]
        rows = [
            torch.arange(s + r * (p // tp), s + (r + 1) * (p // tp))
            for r in range(tp)
            for s, p in zip(starts, self.parts, strict=True)
        ]
        return torch.cat(rows)

    def to_data(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "dim": self.dim,
            "parts": list(self.parts),
            "units": list(self.units),
            "names": list(self.names),
        }

    @classmethod
    def from_data(cls, data: Mapping[str, Any], where: str = "fused_layouts") -> FusedLayout:
        """The layout a plan document holds; a malformed entry is a ``FusedProjectionError``."""
        try:
            out = cls(
                str(data["kind"]),
                int(data["dim"]),
                tuple(int(x) for x in data["parts"]),
                tuple(int(x) for x in data["units"]),
                tuple(str(x) for x in data["names"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FusedProjectionError(
                f"{where}: {data!r} is not a fused layout ({type(e).__name__}: {e}).\n"
                "Fix: re-plan the model; fused_layouts is derived, not written by hand."
            ) from None
        if out.kind not in KINDS or not (len(out.parts) == len(out.units) == len(out.names)):
            raise FusedProjectionError(
                f"{where}: {data!r}: kind must be one of {KINDS} and parts, units and names of "
                "one length.\nFix: re-plan the model; fused_layouts is derived, not hand-written."
            )
        return out


def _int(*values: Any) -> int | None:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _qkv(module: nn.Module, config: Any, n_out: int, dim: int) -> FusedLayout:
    heads = _int(
        *(getattr(module, a, None) for a in ("num_heads", "num_attention_heads", "n_heads")),
        getattr(config, "num_attention_heads", None),
        getattr(config, "n_head", None),
        getattr(config, "n_heads", None),
    )
    hidden = _int(
        getattr(module, "hidden_size", None),
        getattr(config, "hidden_size", None),
        getattr(config, "n_embd", None),
    )
    hd = _int(getattr(module, "head_dim", None), getattr(config, "head_dim", None))
    if hd is None and heads and hidden:
        hd = hidden // heads
    if heads is None or hd is None:
        raise FusedProjectionError(
            f"{type(module).__name__}: cannot read the head count and head_dim of this fused "
            "q/k/v projection from the module or its config.\nFix: keep the boundary whole on tp "
            "(an override replicating its parameters), or add a plugin template for it."
        )
    mt = getattr(config, "model_type", "")
    multi_query = bool(getattr(config, "multi_query", False))
    kv = _int(
        getattr(module, "num_key_value_heads", None),
        getattr(config, "num_key_value_heads", None),
        getattr(config, "num_kv_heads", None) if mt == "falcon" else None,
    )
    if mt == "falcon" and getattr(config, "new_decoder_architecture", False):
        kv = kv or heads
        return FusedLayout("grouped", dim, (n_out,), (kv,), ("qkv",))
    if mt in ("falcon", "gpt_bigcode") and multi_query:
        kv = 1
    elif mt in _INTERLEAVED or mt == "falcon" or mt == "gpt_bigcode":
        return FusedLayout("interleaved", dim, (n_out,), (heads,), ("qkv",))
    kv = kv or heads
    return FusedLayout(
        "concatenated", dim, (heads * hd, kv * hd, kv * hd), (heads, kv, kv), ("q", "k", "v")
    )


def derive(block: nn.Module, rel: str, role: Role, param: torch.Tensor, config: Any) -> FusedLayout:
    """The layout of fused parameter ``rel`` of ``block`` (``config``: the model's config)."""
    path = rel.rpartition(".")[0]
    owner = block.get_submodule(path) if path else block
    config = getattr(block, "config", None) or config
    dim = 1 if is_conv1d(owner) and param.dim() == 2 else 0
    n_out = int(param.shape[dim])
    if role is Role.FUSED_GATE_UP:
        half = n_out // 2
        return FusedLayout(
            "gate_up", dim, (half, n_out - half), (half, n_out - half), ("gate", "up")
        )
    return _qkv(block, config, n_out, dim)


def _unread(block: nn.Module, rel: str, param: torch.Tensor) -> FusedLayout:
    """A fused q/k/v layout whose units no attribute gives: 0, read off the forward by
    ``hp_core.planner.fused_proof`` (which refuses it when no view there gives them)."""
    path = rel.rpartition(".")[0]
    owner = block.get_submodule(path) if path else block
    dim = 1 if is_conv1d(owner) and param.dim() == 2 else 0
    return FusedLayout("concatenated", dim, (int(param.shape[dim]),), (0,), ("qkv",))


def _kv_read(block: nn.Module, config: Any) -> bool:
    """Whether the derivation read a key/value head count (else it assumed one per head)."""
    config = getattr(block, "config", None) or config
    names = ("num_key_value_heads", "num_kv_heads", "multi_query")
    return any(getattr(o, n, None) is not None for o in (block, config) for n in names)


def local_region(block: nn.Module, roles: Mapping[str, Role], tp: int) -> bool:
    """Whether a block's fused parameters are re-arranged (so its region runs on local shards).

    The forward of a concatenated layout slices the fused output at global offsets; on the
    re-arranged DTensor those would cut across ranks, so the region runs on the local
    ``[Q_r; K_r; V_r]`` with local head counts, in validate mode as in production.
    """
    if tp <= 1:
        return False
    config = getattr(block, "config", None)
    for rel, role in roles.items():
        if role not in (Role.FUSED_QKV, Role.FUSED_GATE_UP) or not rel.endswith("weight"):
            continue
        param = block.get_parameter(rel)
        try:
            layout = derive(block, rel, role, param, config)
        except FusedProjectionError:
            return False  # the planner's own derivation refuses it with the message
        if len(layout.parts) > 1:
            return True
    return False


def fused_layouts(
    model: nn.Module,
    fqn: str,
    spec: ModuleShardingSpec,
    mesh: MeshSpec,
    roles: Mapping[str, Role],
) -> dict[str, dict[str, Any]]:
    """``param path -> layout`` (as data) of every fused parameter tp shards on its fused dim.

    Checked here, at plan time: a layout tp cannot split into whole units of every part, or
    one that does not add up to the parameter, is a ``FusedProjectionError``.
    """
    tp = mesh.size("tp")
    params = spec.params if isinstance(spec.params, dict) else {}
    if tp <= 1 or not params:
        return {}
    block = model.get_submodule(fqn) if fqn else model
    out: dict[str, dict[str, Any]] = {}
    for rel, named in params.items():
        role = roles.get(f"{fqn}.{rel}" if fqn else rel)
        placement = named.get("tp")
        if role not in (Role.FUSED_QKV, Role.FUSED_GATE_UP) or not isinstance(placement, Shard):
            continue
        param = block.get_parameter(rel)
        where = f"{fqn}.{rel}" if fqn else rel
        config = getattr(model, "config", None)
        try:
            try:
                layout = derive(block, rel, role, param, config)
            except FusedProjectionError:  # no head count on the module or its config
                layout = _unread(block, rel, param)
            if placement.dim != layout.dim:
                continue  # not split along the fused dim: each rank holds all parts of a slice
            if not all(layout.units):  # the proof reads the units off the forward
                out[rel] = layout.to_data()
                continue
            if layout.size() != param.shape[layout.dim] and not _kv_read(block, config):
                # The kv count was a guess (no attribute holds it): the forward tells.
                out[rel] = _unread(block, rel, param).to_data()
                continue
            if layout.size() != param.shape[layout.dim]:
                raise FusedProjectionError(
                    f"fused projection of shape {tuple(param.shape)}, but its config gives "
                    f"{layout.describe()} (sum {layout.size()}): hp cannot tell how the forward "
                    "splits it.\nFix: keep the boundary whole on tp, or add a plugin template "
                    "for this family."
                )
            layout.check("", tuple(param.shape), tp)
        except FusedProjectionError as e:
            raise propose(
                FusedProjectionError(f"{where}: {str(e).lstrip(': ')}"),
                keep_whole_proposal(fqn, spec),
            ) from None
        out[rel] = layout.to_data()
    return out
