"""``MeshSpec``: a mesh as axis names and sizes, with no process group behind it.

Planning needs only this much, so a plan for a 1,000-GPU mesh can be made and
inspected on a laptop. A real ``DeviceMesh`` converts to a ``MeshSpec`` losslessly.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeAlias, TypeGuard

from hp_core.errors import HpError
from hp_core.spec.keywords import close_matches, keyword_checked

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "MeshLike",
    "MeshSpec",
    "MeshSpecError",
    "is_data_axis",
    "is_device_mesh",
    "mesh_axes",
]

#: A mesh described without a process group: a ``MeshSpec``, ``{axis: size}`` or ``"tp=4,cp=2"``.
MeshLike: TypeAlias = "MeshSpec | Mapping[str, int] | str"

_AXIS = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def is_data_axis(axis: str) -> bool:
    """Data-parallel axes (``dp``, ``dp_shard``, ...) belong to FSDP/DDP, not to hp.

    Their ranks see other batches.
    """
    return str(axis).startswith("dp")


class MeshSpecError(HpError, ValueError):
    """A mesh description that cannot be understood."""


_UNNAMED = (
    "the DeviceMesh has no mesh_dim_names; hp addresses axes by name. Create it with "
    "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))."
)


def is_device_mesh(mesh: object) -> TypeGuard[DeviceMesh]:
    """Whether ``mesh`` is a ``DeviceMesh`` (recognized by its process groups, so that test
    doubles and subclasses count too)."""
    return hasattr(mesh, "get_group")


def mesh_axes(mesh: DeviceMesh) -> tuple[str, ...]:
    """The axis names of a ``DeviceMesh``: torch types them optional, hp requires them."""
    names = mesh.mesh_dim_names
    if names is None:
        raise MeshSpecError(_UNNAMED)
    return tuple(names)


@keyword_checked
@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Axis names and sizes of a device mesh, outermost first."""

    axis_names: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        names = tuple(str(n) for n in self.axis_names)
        sizes = tuple(self.sizes)
        if len(names) != len(sizes):
            raise MeshSpecError(
                f"mesh has {len(names)} axis names {names} but {len(sizes)} sizes {sizes}"
            )
        for n in names:
            if not _AXIS.match(n):
                raise MeshSpecError(
                    f"mesh axis name {n!r} is not an identifier (letters, digits, '_')."
                )
        if len(set(names)) != len(names):
            raise MeshSpecError(f"mesh axis names must be unique, got {names}")
        for n, s in zip(names, sizes, strict=True):
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise MeshSpecError(f"mesh axis {n!r}: size must be a positive integer, got {s!r}")
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "sizes", sizes)

    @classmethod
    def parse(cls, text: str) -> MeshSpec:
        """``"tp=8,cp=2"`` → ``MeshSpec(("tp", "cp"), (8, 2))``."""
        names: list[str] = []
        sizes: list[int] = []
        if not isinstance(text, str) or not text.strip():
            raise MeshSpecError(f"expected a mesh like 'tp=4,cp=2', got {text!r}")
        for part in text.split(","):
            name, sep, size = part.partition("=")
            # ASCII digits only: isdigit() accepts "²" and isdecimal() "٨", which the placement
            # grammar refuses too.
            if not sep or not (size.strip().isascii() and size.strip().isdecimal()):
                raise MeshSpecError(
                    f"mesh {text!r}: {part.strip()!r} is not AXIS=SIZE (e.g. 'tp=4,cp=2')"
                )
            names.append(name.strip())
            sizes.append(int(size))
        return cls(tuple(names), tuple(sizes))

    @classmethod
    def from_any(cls, mesh: DeviceMesh | MeshLike) -> MeshSpec:
        """Accept a ``MeshSpec``, a ``DeviceMesh``, a ``{axis: size}`` mapping or ``"tp=4"``."""
        if isinstance(mesh, MeshSpec):
            return mesh
        if isinstance(mesh, str):
            return cls.parse(mesh)
        if isinstance(mesh, Mapping):
            return cls(tuple(mesh), tuple(mesh.values()))
        names = getattr(mesh, "mesh_dim_names", None)
        shape = getattr(mesh, "shape", None)
        if shape is not None and hasattr(mesh, "get_group"):
            if names is None:
                raise MeshSpecError(_UNNAMED)
            return cls(tuple(names), tuple(int(s) for s in shape))
        raise MeshSpecError(
            "expected a DeviceMesh, a MeshSpec, a {axis: size} mapping or 'tp=4,cp=2', got "
            f"{type(mesh).__name__}"
        )

    def size(self, axis: str) -> int:
        """Size of ``axis``; 1 when the mesh does not have it."""
        try:
            return self.sizes[self.axis_names.index(str(axis))]
        except ValueError:
            return 1

    def __contains__(self, axis: object) -> bool:
        return str(axis) in self.axis_names

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def check_axis(self, axis: str, *, where: str) -> None:
        """Raise naming ``where`` when ``axis`` is not a mesh dimension."""
        if str(axis) not in self.axis_names:
            best = close_matches(axis, self.axis_names, n=1)
            hint = f" Did you mean {best[0]!r}?" if best else ""
            raise MeshSpecError(
                f"{where}: axis {str(axis)!r} is not a dimension of the mesh "
                f"{dict(zip(self.axis_names, self.sizes, strict=True))}.{hint}"
            )

    def __str__(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.axis_names, self.sizes, strict=True))
