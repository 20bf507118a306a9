"""megatron_dapo.hf_files: safetensors headers checked without loading, lazy reads, tied lm_head shapes and
auxiliary files, against the transformers model that wrote the folder (the independent reference)."""

import json
import struct
from pathlib import Path

import pytest
import torch

from megatron_dapo.hf_files import (
    HFCheckpointError,
    SafetensorsReader,
    aux_files,
    checkpoint_shapes,
    copy_aux_files,
    hf_tensor_table,
    read_safetensors_header,
)
from megatron_dapo.tiny import tiny_model

AUX = {"tokenizer.json": "{}\n", "tokenizer_config.json": '{"model_max_length": 64}\n',
       "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}", "merges.txt": "a b\n",
       "README.md": "# tiny\n"}


def _save(folder: Path, *, tied: bool, max_shard_size: str | None = None):
    model = tiny_model("qwen2", seed=0, tied=tied)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kw)
    for name, text in AUX.items():
        (folder / name).write_text(text)
    return model


def _write_safetensors(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sharded")
    model = _save(folder, tied=False, max_shard_size="100KB")
    return folder, model


def test_sharded_folder_reads_every_tensor_lazily(sharded):
    folder, model = sharded
    files = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(files) > 1
    table = hf_tensor_table(folder)
    reader = SafetensorsReader(folder)
    state = model.state_dict()
    assert set(table) == set(state) and set(reader.weight_map) == set(state)
    for name, ref in state.items():
        assert table[name].shape == tuple(ref.shape) and table[name].dtype == "F32"
        assert torch.equal(reader.get(name), ref), name
    assert checkpoint_shapes(folder) == {n: tuple(t.shape) for n, t in state.items()}
    with pytest.raises(HFCheckpointError, match="tensor 'nope' is missing"):
        reader.get("nope")


def test_tied_lm_head_shape_is_filled_from_config(tmp_path):
    model = _save(tmp_path, tied=True)
    assert "lm_head.weight" not in hf_tensor_table(tmp_path)  # transformers stores the tied copy once
    shapes = checkpoint_shapes(tmp_path)
    assert shapes["lm_head.weight"] == tuple(model.lm_head.weight.shape) == shapes["model.embed_tokens.weight"]
    assert shapes == {n: tuple(t.shape) for n, t in model.state_dict().items()}


def test_no_safetensors_means_no_shapes(tmp_path):
    assert checkpoint_shapes(tmp_path) is None
    assert checkpoint_shapes(tmp_path / "Qwen/Qwen2.5-0.5B") is None  # a hub name, not a folder
    with pytest.raises(HFCheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        SafetensorsReader(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(HFCheckpointError, match="only PyTorch .bin weights"):
        hf_tensor_table(tmp_path)


def test_truncated_file_is_named(tmp_path):
    _save(tmp_path, tied=False)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    for read in (hf_tensor_table, SafetensorsReader, checkpoint_shapes):
        with pytest.raises(HFCheckpointError, match=r"model\.safetensors: truncated: .* ends at byte \d+"):
            read(tmp_path)
    path.write_bytes(data[:100])
    with pytest.raises(HFCheckpointError, match="truncated inside its header"):
        read_safetensors_header(path)
    path.write_bytes(data[:5])
    with pytest.raises(HFCheckpointError, match=r"truncated \(5 bytes\): not a safetensors file"):
        read_safetensors_header(path)


def test_corrupt_header_is_named(tmp_path):
    path = tmp_path / "model.safetensors"
    _write_safetensors(path, {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}, bytes(24))
    assert read_safetensors_header(path) == {"w": ("F32", (2, 3))}
    _write_safetensors(path, {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}, bytes(24))
    with pytest.raises(HFCheckpointError, match=r"model\.safetensors: corrupt header: w F32\[2, 3\] spans 20"):
        read_safetensors_header(path)
    _write_safetensors(path, {"w": {"shape": [2, 3], "data_offsets": [0, 24]}}, bytes(24))
    with pytest.raises(HFCheckpointError, match="corrupt safetensors header"):
        read_safetensors_header(path)
    raw = b"{not json at all}"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(HFCheckpointError, match=r"model\.safetensors: corrupt safetensors header"):
        hf_tensor_table(tmp_path)


def test_index_listing_a_missing_file_or_tensor(sharded, tmp_path):
    import shutil

    folder = shutil.copytree(sharded[0], tmp_path / "m")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (folder / first).unlink()
    with pytest.raises(HFCheckpointError, match=rf"index\.json: lists {first}, which is missing"):
        SafetensorsReader(folder)
    shutil.copy2(sharded[0] / first, folder / first)
    moved = next(n for n, f in index["weight_map"].items() if f != first)
    index["weight_map"][moved] = first
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError, match=rf"{moved} is listed in {first} but not stored there"):
        hf_tensor_table(folder)


def test_aux_files_are_every_top_level_non_weight_file(sharded, tmp_path):
    import shutil

    folder = shutil.copytree(sharded[0], tmp_path / "src")
    (folder / "sub").mkdir()
    (folder / "sub" / "nested.txt").write_text("not top level")
    (folder / "training_args.bin").write_bytes(b"weights-like")
    expected = {*AUX, "generation_config.json"}
    assert {p.name for p in aux_files(folder)} == expected
    copied = copy_aux_files(folder, tmp_path / "out" / "hf")
    assert set(copied) == expected and {p.name for p in (tmp_path / "out" / "hf").iterdir()} == expected
    for name in expected:
        assert (tmp_path / "out" / "hf" / name).read_bytes() == (folder / name).read_bytes()
    assert set(copy_aux_files(folder, tmp_path / "with_config", with_config=True)) == expected | {"config.json"}
