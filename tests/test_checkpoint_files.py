"""The single-process parts of ``load_pretrained``: headers, key mapping, slices.

Headers are parsed by hp itself and checked against the file's size (a truncated file
is refused by name, never read past its end); per-expert checkpoint tensors map onto the
stacked expert parameters by the model type's conversion table; a slice of a stacked
tensor reads only the experts and rows it covers.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from hp_core import CorruptSafetensorsError
from hp_core.checkpoint import safetensors_files
from hp_core.checkpoint.key_map import map_keys
from hp_core.checkpoint.safetensors_files import CheckpointFiles
from hp_core.checkpoint.slices import local_ranges, read_local


def _file(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def _raw(path: Path, header: object, data: bytes = b"") -> Path:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


@pytest.mark.parametrize(
    ("name", "make", "says"),
    [
        ("short", lambda p: p.write_bytes(b"abc"), "fewer than the 8-byte header length"),
        ("long_header", lambda p: p.write_bytes(struct.pack("<Q", 999) + b"{}"), "header says"),
        ("not_object", lambda p: _raw(p, [1, 2]), "its header is not a JSON object"),
        ("malformed", lambda p: _raw(p, {"w": {"dtype": "F32"}}), "entry of 'w' is malformed"),
        (
            "size",
            lambda p: _raw(
                p, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"x" * 8
            ),
            "'w' spans 4 bytes but (2,) needs 8",
        ),
    ],
)
def test_bad_headers_are_refused_by_name(tmp_path, name, make, says):
    file = tmp_path / "model.safetensors"
    make(file)
    with pytest.raises(CorruptSafetensorsError) as info:
        CheckpointFiles.open(tmp_path)
    assert str(info.value).startswith(f"{file}: not a complete safetensors file: "), info.value
    assert says in str(info.value) and "Fix: " in str(info.value)


def test_a_bad_index_is_refused(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text('{"no": 1}')
    with pytest.raises(CorruptSafetensorsError, match="not an index with a 'weight_map'"):
        CheckpointFiles.open(tmp_path)


def test_a_single_file_path_and_its_entries(tmp_path):
    file = _file(tmp_path / "weights.safetensors", {"a": torch.zeros(2, 3), "s": torch.tensor(1.5)})
    files = CheckpointFiles.open(file)
    assert sorted(files) == ["a", "s"] and files.config is None
    assert files.entries["a"].shape == (2, 3) and files.entries["a"].dtype == torch.float32
    # A 0-d tensor reads whole with the empty index.
    assert float(safetensors_files.read_slice(files.entries["s"], ())) == 1.5


def _mixtral_like() -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(model_type="mixtral"), base_model_prefix="model")


def test_per_expert_tensors_stack_by_the_conversion_table(tmp_path):
    """Mixtral's table: rename ``block_sparse_moe`` to ``mlp``, stack w1/w3 per expert and
    concatenate them (gate then up), stack w2; keys without the ``model.`` prefix too."""
    g = torch.Generator().manual_seed(0)
    w = {
        f"layers.0.block_sparse_moe.experts.{e}.w{i}.weight": torch.randn(3, 4, generator=g)
        for e in range(2)
        for i in (1, 3)
    }
    w["layers.0.block_sparse_moe.experts.0.w2.weight"] = torch.randn(4, 3, generator=g)
    w["layers.0.block_sparse_moe.experts.1.w2.weight"] = torch.randn(4, 3, generator=g)
    w["extra"] = torch.zeros(1)
    files = CheckpointFiles.open(_file(tmp_path / "model.safetensors", w))
    names = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    sources, unused = map_keys(_mixtral_like(), files.entries, names)
    assert unused == ["extra"]
    gate_up = sources[names[0]]
    assert gate_up.shape == (2, 6, 4) and gate_up.describe().startswith("4 stacked tensors")
    full = torch.stack(
        [
            torch.cat([w[f"layers.0.block_sparse_moe.experts.{e}.w{i}.weight"] for i in (1, 3)])
            for e in range(2)
        ]
    )
    assert torch.equal(read_local(gate_up, local_ranges(gate_up.shape, None)), full)
    # A slice across the gate/up seam of expert 1 only reads expert 1's two tensors.
    seen: list[str] = []
    orig = safetensors_files.read_slice

    def spy(entry, index):
        seen.append(entry.key)
        return orig(entry, index)

    safetensors_files.read_slice = spy
    try:
        part = read_local(gate_up, ((1, 2), (2, 5), (1, 3)))
    finally:
        safetensors_files.read_slice = orig
    assert torch.equal(part, full[1:2, 2:5, 1:3])
    assert seen == [f"layers.0.block_sparse_moe.experts.1.w{i}.weight" for i in (1, 3)]
    seen.clear()
    safetensors_files.read_slice = spy
    try:  # rows of the gate half only: the up tensor is not touched
        part = read_local(gate_up, ((0, 2), (0, 2), (0, 4)))
    finally:
        safetensors_files.read_slice = orig
    assert torch.equal(part, full[:, 0:2]) and all(".w1." in k for k in seen) and len(seen) == 2
    down = sources[names[1]]
    assert down.shape == (2, 4, 3)
