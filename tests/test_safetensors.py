"""zero_ext's safetensors reader and writer (zero_ext/files/weights/safetensors.py):
files the safetensors package writes are read exactly, by byte range;
files zero_ext writes are what the package reads; crafted files and indexes
are refused before a tensor byte is read."""
import json
import os

import pytest
import torch

from zero_ext.files.weights import safetensors as st

safetensors_torch = pytest.importorskip("safetensors.torch")  # installed by scripts/setup.sh


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=g),
        "layer.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "half": torch.randn(3, 2, generator=g).to(torch.float16),
        "steps": torch.arange(6, dtype=torch.int64).view(2, 3),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "fp8": torch.linspace(-2, 2, 8).to(torch.float8_e4m3fn),
    }


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_reads_what_the_package_writes_whole_and_by_range(tmp_path):
    tensors = _tensors()
    path = str(tmp_path / "a.safetensors")
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})
    with st.SafetensorsFile(path) as f:
        assert set(f.keys()) == set(tensors) and f.metadata == {"format": "pt"}
        header = f.bytes_read
        for name, want in tensors.items():
            got = f.tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(_bytes(got), _bytes(want)), name
        assert f.bytes_read == header + sum(t.numel() * t.element_size() for t in tensors.values())
        before = f.bytes_read
        part = f.read("embed.weight", 9, 11)  # a rank's range: exactly its bytes
        assert torch.equal(part, tensors["embed.weight"].flatten()[9:20])
        assert f.bytes_read - before == 11 * 4
        with pytest.raises(IndexError):
            f.read("embed.weight", 30, 6)


def test_the_package_reads_what_zero_ext_writes(tmp_path):
    tensors = _tensors()
    path = str(tmp_path / "b.safetensors")
    st.save_file(path, tensors, metadata={"format": "pt"})
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    back = safetensors_torch.load_file(path)
    for name, want in tensors.items():
        assert back[name].dtype == want.dtype and torch.equal(_bytes(back[name]), _bytes(want)), name
    with open(path, "rb") as f:
        assert (8 + int.from_bytes(f.read(8), "little")) % 8 == 0  # data 8-aligned, as the package writes


def test_writer_refuses_out_of_order_and_leaves_no_file(tmp_path):
    path = str(tmp_path / "c.safetensors")
    w = st.SafetensorsWriter(path, [("a", torch.float32, (2,)), ("b", torch.float32, (3,))])
    with pytest.raises(ValueError):
        w.write("b", torch.zeros(3))
    w.abort()
    assert os.listdir(tmp_path) == []


def test_split_into_files_follows_the_hugging_face_layout():
    entries = [(f"t{i}", torch.float32, (256,)) for i in range(5)]  # 1 KiB each
    files = st.split_into_files(entries, max_bytes=2048)
    assert files == [("model-00001-of-00003.safetensors", [0, 1]), ("model-00002-of-00003.safetensors", [2, 3]),
                     ("model-00003-of-00003.safetensors", [4])]
    assert st.split_into_files(entries, max_bytes=1 << 30) == [("model.safetensors", [0, 1, 2, 3, 4])]
    big = [("big", torch.float32, (4096,)), ("small", torch.float32, (2,))]
    assert [g for _, g in st.split_into_files(big, max_bytes=1024)] == [[0], [1]]


def test_sharded_directory_reads_through_its_index(tmp_path):
    tensors = _tensors()
    names = list(tensors)
    st.save_file(str(tmp_path / "model-00001-of-00002.safetensors"), {n: tensors[n] for n in names[:3]})
    st.save_file(str(tmp_path / "model-00002-of-00002.safetensors"), {n: tensors[n] for n in names[3:]})
    weight_map = {n: f"model-0000{1 if i < 3 else 2}-of-00002.safetensors" for i, n in enumerate(names)}
    st.write_index(str(tmp_path), weight_map, total_size=123)
    with st.SafetensorsDirectory(str(tmp_path)) as d:
        assert d.keys() == names
        assert torch.equal(d.file_of("steps").tensor("steps"), tensors["steps"])


def _write_raw(path, header, data=b""):
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize("header,data,problem", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "outside"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 12"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "share bytes"),
    ({"a": {"dtype": "PICKLE", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "dtype"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", "shape"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}}, b"\0" * 4, "dtype, shape"),
    ({"__metadata__": {"k": 1}}, b"", "__metadata__"),
    ([1, 2], b"", "not a JSON object"),
    (b"[" * 100000 + b"]" * 100000, b"", "nested too deeply"),
    (b"\xff\xfe", b"", "not JSON"),
])
def test_crafted_headers_are_refused(tmp_path, header, data, problem):
    path = str(tmp_path / "bad.safetensors")
    _write_raw(path, header, data)
    with pytest.raises(ValueError, match=problem):
        st.SafetensorsFile(path)


def test_header_length_beyond_the_file_is_refused(tmp_path):
    path = str(tmp_path / "bad.safetensors")
    with open(path, "wb") as f:
        f.write((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="exceeds the file"):
        st.SafetensorsFile(path)


def test_links_and_paths_out_of_the_directory_are_refused(tmp_path):
    outside = tmp_path / "outside"
    inside = tmp_path / "model"
    outside.mkdir()
    inside.mkdir()
    st.save_file(str(outside / "secret.safetensors"), {"w": torch.ones(2)})
    for target in ("../outside/secret.safetensors", "/etc/passwd", "sub/x.safetensors", "model.bin"):
        st.write_index(str(inside), {"w": target}, total_size=8)
        with pytest.raises(ValueError, match="only .safetensors files in its own directory"):
            st.SafetensorsDirectory(str(inside))
    os.symlink(outside / "secret.safetensors", inside / "model-00001-of-00001.safetensors")
    st.write_index(str(inside), {"w": "model-00001-of-00001.safetensors"}, total_size=8)
    with pytest.raises(ValueError, match="links"):
        st.SafetensorsDirectory(str(inside))
    os.unlink(inside / st.INDEX)
    os.symlink(outside / "secret.safetensors", inside / "model.safetensors")
    with pytest.raises(ValueError, match="links"):
        st.SafetensorsDirectory(str(inside))


def test_index_naming_a_tensor_its_file_lacks_is_refused(tmp_path):
    st.save_file(str(tmp_path / "model-00001-of-00001.safetensors"), {"w": torch.ones(2)})
    st.write_index(str(tmp_path), {"w": "model-00001-of-00001.safetensors",
                                   "v": "model-00001-of-00001.safetensors"}, total_size=8)
    with pytest.raises(ValueError, match="does not hold it"):
        st.SafetensorsDirectory(str(tmp_path))


def test_shard_sizes_read_as_transformers_writes_them():
    assert [st.parse_size(x) for x in ("200", "5GB", "500MiB", "1.5KB", 7)] == [200, 5 * 10**9, 500 * 2**20, 1500, 7]
    for bad in ("0", "lots", "-1", True, 0, 2.5):
        with pytest.raises(ValueError, match="max_shard_size"):
            st.parse_size(bad)
