"""The checkpoint format without processes: safetensors I/O, the JSON codec, tags, `latest`, sizes."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import safetensors.torch
import torch

from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.export import parse_size, split_files
from zeroshard.checkpoint.format import check_tag, decode, encode, read_metadata, resolve, write_latest
from zeroshard.checkpoint.tensorfile import TensorFile, TensorSpec, sha256_file, verify_file, write_tensors

ALL_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        f"t_{str(d).removeprefix('torch.')}": (torch.randn(3, 5, generator=g) * 100).to(d) for d in ALL_DTYPES
    }
    out["scalar"] = torch.tensor(7.0)
    out["empty"] = torch.zeros(0, 4)
    out["strided"] = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous input is written contiguously
    return out


def test_written_files_are_standard_safetensors(tmp_path: Any) -> None:
    tensors = _tensors()
    path = str(tmp_path / "a.safetensors")
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    record = write_tensors(path, specs, iter(tensors.values()), {"format": "pt"})
    assert record.nbytes == os.path.getsize(path) and record.sha256 == sha256_file(path)
    back = safetensors.torch.load_file(path)  # the reference reader agrees
    for key, t in tensors.items():
        assert torch.equal(back[key], t), key
    with TensorFile(path) as f:  # and ours reads files the reference writer made
        assert f.metadata == {"format": "pt"}
        for key, t in tensors.items():
            assert torch.equal(f.read_tensor(key), t), key
    ref = str(tmp_path / "b.safetensors")
    safetensors.torch.save_file({k: t.contiguous() for k, t in tensors.items()}, ref)
    with TensorFile(ref) as f:
        for key, t in tensors.items():
            assert torch.equal(f.read_tensor(key), t), key


def test_range_reads_fill_the_callers_tensor(tmp_path: Any) -> None:
    path = str(tmp_path / "r.safetensors")
    x = torch.arange(100, dtype=torch.float32)
    write_tensors(path, [TensorSpec("x", torch.float32, (100,))], [x])
    buf = torch.full((30,), -1.0)
    with TensorFile(path) as f:
        out = f.read("x", 10, 20, out=buf[5:15])
        assert out.data_ptr() == buf[5:15].data_ptr()
        assert (
            torch.equal(buf[5:15], x[10:20]) and bool((buf[:5] == -1).all()) and bool((buf[15:] == -1).all())
        )
        with pytest.raises(CheckpointError, match="outside"):
            f.read("x", 90, 101)
        with pytest.raises(CheckpointError, match="no tensor 'y'"):
            f.read("y")


def test_writer_checks_what_it_is_given(tmp_path: Any) -> None:
    path = str(tmp_path / "w.safetensors")
    with pytest.raises(CheckpointError, match=r"expected torch\.float32"):
        write_tensors(path, [TensorSpec("x", torch.float32, (2,))], [torch.zeros(2, dtype=torch.float16)])
    with pytest.raises(CheckpointError, match="no tensor was produced for 'y'"):
        write_tensors(
            path,
            [TensorSpec("x", torch.float32, (2,)), TensorSpec("y", torch.float32, (1,))],
            [torch.zeros(2)],
        )


def test_damaged_files_give_errors_naming_the_file(tmp_path: Any) -> None:
    path = str(tmp_path / "d.safetensors")
    record = write_tensors(path, [TensorSpec("x", torch.float32, (1000,))], [torch.ones(1000)])
    verify_file(path, record.nbytes, record.sha256)
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x00")
    with pytest.raises(
        CheckpointError, match=r"d\.safetensors has the recorded size but not the recorded sha256"
    ):
        verify_file(path, record.nbytes, record.sha256)
    os.truncate(path, record.nbytes - 100)
    with pytest.raises(
        CheckpointError, match=r"d\.safetensors has \d+ bytes but metadata.json records \d+: it is truncated"
    ):
        verify_file(path, record.nbytes, record.sha256)
    with pytest.raises(CheckpointError, match="truncated"):
        TensorFile(path)
    os.truncate(path, 4)
    with pytest.raises(CheckpointError, match="too short"):
        TensorFile(path)
    with pytest.raises(CheckpointError, match=r"missing.safetensors is missing"):
        verify_file(str(tmp_path / "missing.safetensors"), 1, None)


def test_codec_round_trips_json_values_and_tensors() -> None:
    value = {
        "a": 1,
        "b": [1.5, float("inf"), None, True],
        "t": (1, (2, "x")),
        "ints": {3: "three", (1, 2): 4},
        "x": torch.arange(3),
        "dtype": torch.bfloat16,
        "__dunder": 1,
        "nested": [{"y": torch.ones(2)}],
    }
    sink: dict[str, torch.Tensor] = {}
    encoded = encode(value, "v", sink)
    text = json.dumps(encoded)  # plain JSON, no pickles
    decoded = decode(json.loads(text), sink.__getitem__)
    assert decoded["t"] == (1, (2, "x")) and decoded["ints"] == {3: "three", (1, 2): 4}
    assert decoded["dtype"] is torch.bfloat16 and decoded["__dunder"] == 1 and decoded["b"][1] == float("inf")
    assert torch.equal(decoded["x"], torch.arange(3)) and torch.equal(
        decoded["nested"][0]["y"], torch.ones(2)
    )


def test_codec_refuses_what_would_need_pickle() -> None:
    with pytest.raises(CheckpointError, match=r"client_state.f: a builtins.function cannot be stored"):
        encode({"f": lambda: 0}, "client_state", {})
    with pytest.raises(CheckpointError, match=r"x\[1\]: a builtins.set"):
        encode([1, {2}], "x", {})


@pytest.mark.parametrize("tag", ["", ".hidden", "a/b", "..", "latest", "x y"])
def test_bad_tags(tag: str) -> None:
    with pytest.raises(ValueError, match="not usable as a directory name"):
        check_tag(tag)


def test_latest_and_tag_resolution(tmp_path: Any) -> None:
    root = str(tmp_path)
    assert resolve(root, None) is None  # no latest: the caller warns
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve(root, "nope")
    os.makedirs(os.path.join(root, "step1"))
    write_latest(root, "step1", "tok")
    assert resolve(root, None) == os.path.join(root, "step1")
    assert sorted(os.listdir(root)) == ["latest", "step1"]  # the temporary file was renamed away
    # A save replacing step1 that died between its two renames leaves only the renamed-aside copy.
    os.rename(os.path.join(root, "step1"), os.path.join(root, ".step1.old-abc"))
    assert resolve(root, None) == os.path.join(root, ".step1.old-abc")
    with pytest.raises(CheckpointError, match=r"is not a zeroshard checkpoint: it has no metadata\.json"):
        read_metadata(os.path.join(root, ".step1.old-abc"))


def test_shard_size_parsing_and_file_split() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(300) == 300
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("five")
    specs = [TensorSpec(str(i), torch.float32, (n,)) for i, n in enumerate([10, 10, 100, 5, 5])]
    assert [[s.key for s in f] for f in split_files(specs, 80)] == [["0", "1"], ["2"], ["3", "4"]]
