"""What a boundary template sees: the block, the mesh, the active axes and the layouts."""

from __future__ import annotations

import dataclasses

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from hp_core.mesh import MeshSpec
from hp_core.planner.structure import Block, first_input_name, returns_tuple
from hp_core.spec.placements import NamedPlacement

__all__ = ["TemplateContext"]

R = Replicate()
P = Partial()
S0 = Shard(0)
S1 = Shard(1)


@dataclasses.dataclass
class TemplateContext:
    """Everything a :class:`~hp_core.planner.templates.roles.BoundaryTemplate` needs for a spec.

    Layout helpers only name axes the mesh has: ``tp`` (tensor parallel, with sequence
    parallel when ``sequence_parallel``) and ``cp`` (context parallel; activations stay
    sequence-sharded on it everywhere).
    """

    block: Block
    mesh: MeshSpec
    sequence_parallel: bool
    loss_parallel: bool
    ep_size: int
    is_first_layer: bool = False
    #: The model's HF architectures (or its class name): what plugin items are scoped to.
    architectures: tuple[str, ...] = ()

    @property
    def fqn(self) -> str:
        return self.block.fqn

    @property
    def tp(self) -> int:
        return self.mesh.size("tp")

    @property
    def cp(self) -> int:
        return self.mesh.size("cp")

    @property
    def has_tp(self) -> bool:
        return "tp" in self.mesh

    @property
    def sp_active(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    def layout(self, *, tp: Placement | None = None) -> NamedPlacement:
        """A layout with ``tp`` as given (when the mesh has tp) and ``cp`` sequence-sharded."""
        out: NamedPlacement = {}
        if "cp" in self.mesh:
            out["cp"] = S1
        if tp is not None and self.has_tp:
            out["tp"] = tp
        return out

    def replicated(self) -> NamedPlacement:
        """A parameter layout replicated on every planned axis."""
        out: NamedPlacement = {}
        if "cp" in self.mesh:
            out["cp"] = R
        if self.has_tp:
            out["tp"] = R
        return out

    def tp_param(self, placement: Placement) -> NamedPlacement:
        """A parameter layout sharded (or not) on tp, replicated elsewhere."""
        out = self.replicated()
        if self.has_tp:
            out["tp"] = placement
        return out

    @property
    def hidden(self) -> NamedPlacement:
        """Activations between blocks: sequence-sharded on tp under SP, else replicated."""
        return self.layout(tp=S1 if self.sp_active else R)

    @property
    def gathered(self) -> NamedPlacement:
        """Activations inside a tensor-parallel block: whole sequence on tp."""
        return self.layout(tp=R)

    @property
    def embed_out(self) -> NamedPlacement:
        """The embedding's output: replicated on tp, so model-level code sees the whole sequence."""
        return self.layout(tp=R)

    @property
    def partial(self) -> NamedPlacement:
        return self.layout(tp=P)

    def first_input(self) -> str:
        return first_input_name(self.block.module)

    def inputs_io(self, layout: NamedPlacement) -> dict[str, NamedPlacement]:
        """:meth:`io` of the first input and of every parameter the call gave the same tensor
        (:attr:`Block.first_aliases`): one activation, one layout, whatever it is called."""
        out = self.io(self.first_input(), layout)
        for name in self.block.first_aliases:
            out.update(self.io(name, layout))
        return out

    def returns_tuple(self) -> bool:
        """What the trace saw the forward return; the annotation where it did not run."""
        if self.block.tuple_out is not None:
            return self.block.tuple_out
        return returns_tuple(self.block.module)

    @staticmethod
    def io(name: str, layout: NamedPlacement) -> dict[str, NamedPlacement]:
        """``{name: layout}``, or ``{}`` when the layout names no axis."""
        return {name: dict(layout)} if layout else {}
