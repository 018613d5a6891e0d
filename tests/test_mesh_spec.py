"""``MeshSpec``: a mesh as names and sizes (no process group), its parser and its checks."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hp_core.mesh import MeshSpec, MeshSpecError
from hp_core.spec import MeshAxisName


def test_parse_and_views():
    mesh = MeshSpec.parse(" dp = 2, tp=4 ,cp=2")
    assert mesh == MeshSpec(("dp", "tp", "cp"), (2, 4, 2))
    assert (mesh.size("tp"), mesh.size("cp"), mesh.size("ep")) == (4, 2, 1)
    assert "tp" in mesh and MeshAxisName.cp in mesh and "ep" not in mesh
    assert mesh.world_size == 16
    assert str(mesh) == "dp=2,tp=4,cp=2"
    assert MeshSpec.parse(str(mesh)) == mesh
    assert MeshSpec.parse("tp=8").sizes == (8,)


def test_names_and_sizes_are_normalized():
    mesh = MeshSpec([MeshAxisName.tp, "cp"], [2, 2])
    assert mesh.axis_names == ("tp", "cp") and type(mesh.axis_names[0]) is str
    assert mesh.sizes == (2, 2)
    assert hash(mesh) == hash(MeshSpec(("tp", "cp"), (2, 2)))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected a mesh like 'tp=4,cp=2', got ''"),
        ("   ", "expected a mesh like 'tp=4,cp=2', got '   '"),
        ("tp", "mesh 'tp': 'tp' is not AXIS=SIZE (e.g. 'tp=4,cp=2')"),
        ("tp:4", "mesh 'tp:4': 'tp:4' is not AXIS=SIZE"),
        ("tp=four", "'tp=four' is not AXIS=SIZE"),
        ("tp=-1", "'tp=-1' is not AXIS=SIZE"),
        ("tp=2²", "'tp=2²' is not AXIS=SIZE"),
        ("tp=٨", "'tp=٨' is not AXIS=SIZE"),  # an Arabic-Indic digit: ASCII only
        ("tp=2,", "mesh 'tp=2,': '' is not AXIS=SIZE"),
        ("tp=0", "mesh axis 'tp': size must be a positive integer, got 0"),
        ("tp=2,tp=2", "mesh axis names must be unique, got ('tp', 'tp')"),
        ("=2", "mesh axis name '' is not an identifier (letters, digits, '_')."),
        ("t-p=2", "mesh axis name 't-p' is not an identifier"),
    ],
)
def test_parse_errors(text, message):
    with pytest.raises(MeshSpecError) as info:
        MeshSpec.parse(text)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_parse_needs_a_string():
    with pytest.raises(MeshSpecError, match="expected a mesh like 'tp=4,cp=2', got 4"):
        MeshSpec.parse(4)


@pytest.mark.parametrize(
    ("names", "sizes", "message"),
    [
        (("tp", "cp"), (2,), "mesh has 2 axis names ('tp', 'cp') but 1 sizes (2,)"),
        (("tp",), ("2",), "mesh axis 'tp': size must be a positive integer, got '2'"),
        (("tp",), (True,), "mesh axis 'tp': size must be a positive integer, got True"),
        (("tp",), (2.0,), "got 2.0"),
        (("1tp",), (2,), "mesh axis name '1tp' is not an identifier"),
    ],
)
def test_validation_errors(names, sizes, message):
    with pytest.raises(MeshSpecError) as info:
        MeshSpec(names, sizes)
    assert message in str(info.value)


def test_from_any():
    ref = MeshSpec(("tp", "cp"), (4, 2))
    assert MeshSpec.from_any(ref) is ref
    assert MeshSpec.from_any("tp=4,cp=2") == ref
    assert MeshSpec.from_any({"tp": 4, "cp": 2}) == ref
    with pytest.raises(
        MeshSpecError, match="mesh axis 'tp': size must be a positive integer, got '4'"
    ):
        MeshSpec.from_any({"tp": "4"})
    with pytest.raises(
        MeshSpecError,
        match=r"expected a DeviceMesh, a MeshSpec, a \{axis: size\} mapping or 'tp=4,cp=2', got "
        r"list",
    ):
        MeshSpec.from_any(["tp", 4])


class _NamelessMesh:
    """Quacks like a DeviceMesh created without mesh_dim_names."""

    shape = (4,)
    mesh_dim_names = None

    def get_group(self, *args):  # pragma: no cover - never called
        raise AssertionError


def test_device_mesh_without_names():
    with pytest.raises(MeshSpecError) as info:
        MeshSpec.from_any(_NamelessMesh())
    assert str(info.value) == (
        "the DeviceMesh has no mesh_dim_names; hp addresses axes by name. Create it with "
        "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))."
    )


def test_a_real_device_mesh_converts_losslessly():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # pragma: no cover - another test left a process group behind
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group(backend="fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        assert MeshSpec.from_any(mesh) == MeshSpec(("dp", "tp"), (2, 2))
        assert MeshSpec.from_any(mesh["tp"]) == MeshSpec(("tp",), (2,))
        with pytest.raises(MeshSpecError, match="has no mesh_dim_names"):
            MeshSpec.from_any(init_device_mesh("cpu", (4,)))
    finally:
        dist.destroy_process_group()


def test_check_axis():
    mesh = MeshSpec.parse("dp=2,tp=4")
    mesh.check_axis("tp", where="x")
    with pytest.raises(MeshSpecError) as info:
        mesh.check_axis("tpp", where="overrides[0].params.w")
    assert str(info.value) == (
        "overrides[0].params.w: axis 'tpp' is not a dimension of the mesh {'dp': 2, 'tp': "
        "4}. Did you mean 'tp'?"
    )
    with pytest.raises(
        MeshSpecError, match=r"axis 'zz' is not a dimension of the mesh \{'dp': 2, 'tp': 4\}\.$"
    ):
        mesh.check_axis("zz", where="here")
