"""What a CP wrapper learned when hp bound it to its module: the module, the cp group and
the layout config; and the check that a batch's :class:`CPLayout` fits them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from hp_plugin_cp.errors import CPBatchError, CPConfigError
from hp_plugin_cp.layout import CP_LAYOUT_KEY, CPLayout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Binding", "module_name"]


def module_name(module: nn.Module) -> str:
    """The module's FQN (recorded by hp's applier on inner-wrap targets) or a description."""
    fqn = getattr(module, "_hp_fqn", None)
    if fqn is not None:
        return f"{fqn!r} ({type(module).__name__})"
    layer = getattr(module, "layer_idx", None)
    return type(module).__name__ + (f" (layer_idx={layer})" if layer is not None else "")


class Binding:
    """What a wrapper learned at apply time: its module, the cp group and its config."""

    def __init__(
        self,
        wrapper: str,
        module: nn.Module,
        cp_mesh: DeviceMesh | None,
        load_balanced: bool | None,
    ) -> None:
        self.wrapper = wrapper
        self.module = module
        self.where = f"{wrapper} on {module_name(module)}"
        if cp_mesh is None:
            raise CPConfigError(
                f"{self.where}: the mesh has no active cp axis.\n"
                "A context-parallel wrapper needs cp > 1 on the mesh.\n"
                "Fix: add cp to the mesh, or guard the override with 'when: cp'."
            )
        self.group = cp_mesh.get_group()
        self.cp_size = cp_mesh.size()
        self.cp_rank = cp_mesh.get_local_rank()
        self.load_balanced = load_balanced
        self._auto: dict[int, CPLayout] = {}

    def layout(self, given: Any, local_len: int) -> CPLayout:
        """The batch's layout (checked against this mesh and config) or one derived from it."""
        if given is None:
            if local_len not in self._auto:
                self._auto = {
                    local_len: CPLayout(
                        self.cp_size,
                        self.cp_rank,
                        local_len * self.cp_size,
                        bool(self.load_balanced),
                    )
                }
            return self._auto[local_len]
        if not isinstance(given, CPLayout):
            raise CPBatchError(
                f"{self.where}: keyword {CP_LAYOUT_KEY!r} is a {type(given).__name__}.\n"
                f"{CP_LAYOUT_KEY!r} must be a CPLayout (from shard_batch_for_cp).\n"
                f"Fix: pass the batch shard_batch_for_cp returned, its {CP_LAYOUT_KEY!r} unchanged."
            )
        if (given.cp_size, given.cp_rank) != (self.cp_size, self.cp_rank):
            raise CPBatchError(
                f"{self.where}: the batch was sharded for cp rank {given.cp_rank} of "
                f"{given.cp_size}, but this rank is {self.cp_rank} of {self.cp_size}.\n"
                "Each rank must get the chunk of its own cp rank.\n"
                "Fix: call shard_batch_for_cp with this model's cp mesh."
            )
        if self.load_balanced is not None and self.load_balanced != given.load_balanced:
            raise CPBatchError(
                f"{self.where}: the plan says load_balanced: {str(self.load_balanced).lower()} but "
                f"the batch was sharded with load_balanced={given.load_balanced}.\n"
                "The wrapper and the batch must use one layout.\n"
                "Fix: drop load_balanced from the wrapper config (it then follows the batch), or "
                f"shard the batch with load_balanced={self.load_balanced}."
            )
        return given
