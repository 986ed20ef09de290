"""Checkpoint files written through an aligned buffer with direct I/O (zeroshard/checkpoint/file_sink.py
[Note: direct checkpoint writes]): the same bytes and SHA-256 as a plain write, at every size around the
buffer's, on a file system with direct I/O (the repository's), one without it (tmpfs, where there is one),
and when a write refuses it."""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
from pathlib import Path

import pytest

from zeroshard.checkpoint import file_sink
from zeroshard.checkpoint.file_sink import BOUNCE, FileSink

SIZES = [0, 1, 4095, 4096, BOUNCE - 1, BOUNCE, BOUNCE + 1, 3 * BOUNCE + 4097]


def _write(path: Path, pieces: list[bytes]) -> tuple[int, str]:
    with FileSink(str(path)) as sink:
        for piece in pieces:
            sink.write(piece)
        return sink.close()


def _check(folder: Path) -> None:
    for size in SIZES:
        data = os.urandom(size)
        # Pieces of uneven sizes, as a header and tensors arrive.
        cuts = sorted({0, size, *(size * k // 7 for k in range(1, 7))})
        pieces = [data[a:b] for a, b in itertools.pairwise(cuts)]
        path = folder / f"f{size}"
        nbytes, sha256 = _write(path, pieces)
        assert (nbytes, sha256) == (size, hashlib.sha256(data).hexdigest())
        assert path.read_bytes() == data


def test_bytes_and_checksum_with_direct_io(tmp_path: Path) -> None:
    _check(tmp_path)


def test_bytes_and_checksum_without_direct_io(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_sink, "_DIRECT", 0)  # as where os.O_DIRECT does not exist
    _check(tmp_path)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):  # tmpfs: the open refuses O_DIRECT
        monkeypatch.undo()
        folder = shm / f"zeroshard-test-{os.getpid()}"
        folder.mkdir()
        try:
            _check(folder)
        finally:
            for f in folder.iterdir():
                f.unlink()
            folder.rmdir()


def test_a_write_that_refuses_direct_io_goes_on_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.write
    refused: list[int] = []

    def write(fd: int, data: memoryview) -> int:
        import fcntl

        if file_sink._DIRECT and fcntl.fcntl(fd, fcntl.F_GETFL) & file_sink._DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    _check(tmp_path)
    assert refused or not file_sink._DIRECT


def test_a_full_disk_is_an_error_naming_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "write", lambda fd, data: len(data) // 2)
    with pytest.raises(OSError, match="disk full") as caught:
        _write(tmp_path / "full", [b"x" * (BOUNCE + 1)])
    assert caught.value.filename == str(tmp_path / "full")
