"""Safetensors files, written as a stream and read by element range, with sizes and sha256 checksums.

[Note: why our own safetensors I/O]
The files are standard safetensors (8-byte little-endian header length, a JSON header, then the raw
tensors back to back), so ``safetensors.torch.load_file`` and ``from_pretrained`` read them. We write and
read them here rather than through ``safetensors.torch.save_file`` / ``safe_open`` for memory:
``save_file`` serializes every tensor of a file into one ``bytes`` object before writing (a second copy of
the whole shard), while :func:`write_tensors` writes one tensor at a time straight from its storage and
hashes the bytes as they go out, so a file is never read back to checksum it. :class:`TensorFile` reads an
element range of one tensor with a single ``readinto`` into the caller's tensor (for a checkpoint load, a
view of the master shard itself): no memory map, no temporary, so peak memory is exactly what the caller
allocates.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.file_sink import FileSink

# Header sizes above this are corrupt files, not checkpoints (safetensors itself refuses > 100 MB).
_MAX_HEADER = 100 * 1024 * 1024
_HASH_CHUNK = 8 * 1024 * 1024

_TO_CODE: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_FROM_CODE = {code: dtype for dtype, code in _TO_CODE.items()}


def dtype_code(dtype: torch.dtype) -> str:
    if dtype not in _TO_CODE:
        raise CheckpointError(f"tensors of dtype {dtype} cannot be stored in safetensors")
    return _TO_CODE[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``, the spelling used in metadata.json."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """A tensor a file will hold: its key, dtype and shape, known before any data is written."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class FileRecord:
    """Size and sha256 of a written file, as metadata.json records them."""

    nbytes: int
    sha256: str


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy where it is already a contiguous CPU tensor."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.contiguous().view(torch.uint8).numpy().data


def write_tensors(
    path: str,
    specs: Sequence[TensorSpec],
    tensors: Iterable[torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> FileRecord:
    """Write a safetensors file holding ``specs``, taking each tensor from ``tensors`` in the same order.

    ``tensors`` may be a generator that builds each tensor only when asked (export streams one parameter
    at a time this way). The file is fsynced before returning.

    Raises:
        CheckpointError: a tensor whose dtype or shape differs from its spec, or too few tensors.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for spec in specs:
        header[spec.key] = {
            "dtype": dtype_code(spec.dtype),
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data section to 8 bytes
    with FileSink(path) as f:  # [Note: direct checkpoint writes]
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        it = iter(tensors)
        for spec in specs:
            tensor = next(it, None)
            if tensor is None:
                raise CheckpointError(f"{path}: no tensor was produced for {spec.key!r}")
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                raise CheckpointError(
                    f"{path}: tensor {spec.key!r} is {tensor.dtype} {tuple(tensor.shape)}, expected "
                    f"{spec.dtype} {spec.shape}"
                )
            f.write(_raw_bytes(tensor))
            del tensor  # before the next tensor is produced: one in memory at a time
        written, sha256 = f.close()
    return FileRecord(nbytes=written, sha256=sha256)


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_file(path: str, nbytes: int, sha256: str | None) -> None:
    """Check that ``path`` exists with the recorded size and (when given) checksum.

    Raises:
        CheckpointError: naming the file and what is wrong with it.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing (metadata.json lists it)")
    size = os.path.getsize(path)
    if size != nbytes:
        raise CheckpointError(
            f"checkpoint file {path} has {size} bytes but metadata.json records {nbytes}: it is "
            f"{'truncated' if size < nbytes else 'longer than written'} or was replaced"
        )
    if sha256 is not None and sha256_file(path) != sha256:
        raise CheckpointError(
            f"checkpoint file {path} has the recorded size but not the recorded sha256: it is corrupt"
        )


def fsync_dir(path: str) -> None:
    """Make a rename or a new file inside ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return (self.end - self.begin) // self.dtype.itemsize


class TensorFile:
    """A safetensors file opened for reading element ranges of its tensors (no memory map).

    Raises CheckpointError on a malformed header or a file shorter than its header says.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._f: io.BufferedReader = open(path, "rb")  # closed by close() / the context manager
        try:
            self._parse_header()
        except BaseException:
            self._f.close()
            raise

    def _parse_header(self) -> None:
        size = os.fstat(self._f.fileno()).st_size
        raw = self._f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{self.path}: {size} bytes is too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(
                f"{self.path}: header length {n} does not fit a {size}-byte file (truncated?)"
            )
        try:
            header = json.loads(self._f.read(n))
        except ValueError as err:
            raise CheckpointError(f"{self.path}: the safetensors header is not valid JSON: {err}") from err
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: the safetensors header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self._entries: dict[str, _Entry] = {}
        end_of_data = 0
        for key, info in header.items():
            try:
                dtype = _FROM_CODE[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointError(f"{self.path}: malformed header entry {key!r}: {err!r}") from err
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * dtype.itemsize or begin < 0:
                raise CheckpointError(f"{self.path}: entry {key!r} has offsets {begin}:{end} for {shape}")
            self._entries[key] = _Entry(dtype, shape, begin, end)
            end_of_data = max(end_of_data, end)
        if self._data_start + end_of_data > size:
            raise CheckpointError(
                f"{self.path}: the header describes {self._data_start + end_of_data} bytes but the file has "
                f"{size}: it is truncated"
            )

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def _entry(self, key: str) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise CheckpointError(f"{self.path}: has no tensor {key!r}")
        return entry

    def read(
        self, key: str, start: int = 0, end: int | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elements ``[start, end)`` of tensor ``key`` in flat order, as a 1-D tensor.

        ``out``, when given, receives them: a contiguous tensor of the stored dtype with ``end - start``
        elements (a view of a larger buffer is fine). CPU tensors are filled without a copy.
        """
        entry = self._entry(key)
        end = entry.numel if end is None else end
        if not 0 <= start <= end <= entry.numel:
            raise CheckpointError(
                f"{self.path}: range {start}:{end} is outside {key!r} ({entry.numel} elements)"
            )
        target = out if out is not None else torch.empty(end - start, dtype=entry.dtype)
        if target.dtype != entry.dtype or target.numel() != end - start or not target.is_contiguous():
            raise CheckpointError(
                f"{self.path}: cannot read {key!r}[{start}:{end}] ({entry.dtype}) into a "
                f"{'non-contiguous ' if not target.is_contiguous() else ''}{target.dtype} tensor of "
                f"{target.numel()} elements"
            )
        host = target if target.device.type == "cpu" else torch.empty_like(target, device="cpu")
        nbytes = (end - start) * entry.dtype.itemsize
        if nbytes:
            self._f.seek(self._data_start + entry.begin + start * entry.dtype.itemsize)
            got = self._f.readinto(host.reshape(-1).view(torch.uint8).numpy().data)
            if got != nbytes:
                raise CheckpointError(
                    f"{self.path}: short read of {key!r} ({got} of {nbytes} bytes): truncated"
                )
        if host is not target:
            target.copy_(host)
        return target.reshape(-1)

    def read_tensor(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` with its stored shape."""
        return self.read(key).reshape(self._entry(key).shape)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entry(key).shape

    def dtype(self, key: str) -> torch.dtype:
        return self._entry(key).dtype

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
