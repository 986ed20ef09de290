"""NvmeStore: round trips, direct and buffered paths, file life cycle, start-up checks and worker errors."""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections import namedtuple
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from zeroshard.config.blocks import AioConfig
from zeroshard.offload import swapfile
from zeroshard.offload.nvme import ALIGN, AioSettings, NvmeStore

KEY = "zero_optimization.offload_optimizer.nvme_path"
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]
SIZES = [1, 4095, 4097, 3 * 2**20 + 5]
# Small blocks and a shallow queue: many batches per tensor, so requests interleave in the pool.
SMALL = AioSettings(block_size=2 * ALIGN, queue_depth=2, intra_op_parallelism=3)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[NvmeStore]:
    s = NvmeStore(str(tmp_path), rank=3, purpose="test", capacity_bytes=1 << 20, aio=SMALL)
    yield s
    s.close()


def _data(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=g)
    return torch.randn(numel, generator=g).to(dtype)


def _unaligned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(numel + 1, dtype=dtype)[1:]
    assert t.data_ptr() % ALIGN != 0
    return t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("aio", [AioSettings(), SMALL], ids=["defaults", "small-blocks"])
def test_round_trip_many_requests_from_several_threads(tmp_path: Path, aio: AioSettings) -> None:
    cases = {f"{d}-{n}": _data(n, d, i) for i, (d, n) in enumerate((d, n) for d in DTYPES for n in SIZES)}
    with NvmeStore(str(tmp_path), rank=0, purpose="rt", capacity_bytes=0, aio=aio) as store:
        # Sources alternate between aligned (direct) and unaligned (buffered) buffers.
        sources = {}
        for i, (k, t) in enumerate(cases.items()):
            sources[k] = store.empty(t.numel(), t.dtype) if i % 2 else _unaligned(t.numel(), t.dtype)
            sources[k].copy_(t)
        with ThreadPoolExecutor(4) as callers:
            writes = list(callers.map(lambda kv: store.write(*kv), sources.items()))
        for f in writes:
            f.result(timeout=60)
        outs: dict[str, torch.Tensor] = {}
        reads: list[Future[None]] = []
        for i, (k, t) in enumerate(cases.items()):
            outs[k] = _unaligned(t.numel(), t.dtype) if i % 2 else store.empty(t.numel(), t.dtype)
            reads.append(store.read(k, outs[k]))
        store.synchronize(timeout_s=60)
        assert all(f.done() for f in reads)
        for k, t in cases.items():
            assert _same(outs[k], t), k
        total = sum(t.nbytes for t in cases.values())
        assert store.stats.bytes_written == total and store.stats.bytes_read == total
        assert store.stats.requests == 2 * len(cases)
        assert store.stats.write_seconds > 0 and store.stats.read_seconds > 0


def test_empty_is_aligned_and_overwrite_keeps_latest(store: NvmeStore) -> None:
    for dtype in DTYPES:
        for n in (0, 1, 4097):
            t = store.empty(n, dtype)
            assert t.data_ptr() % ALIGN == 0 or n == 0
            assert (t.numel(), t.dtype, t.is_contiguous()) == (n, dtype, True)
    a = store.empty(5000, torch.float32)
    for value in (1.0, 2.0):
        a.fill_(value)
        store.write("k", a).result(timeout=30)
    out = torch.zeros(5000)
    store.read("k", out).result(timeout=30)
    assert bool((out == 2.0).all())
    empty = torch.empty(0)
    store.write("nothing", empty).result(timeout=30)
    store.read("nothing", torch.empty(0)).result(timeout=30)


def test_without_o_direct_falls_back_to_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def refuse_direct(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument (as tmpfs says)")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_direct)
    with NvmeStore(str(tmp_path), rank=0, purpose="tmpfs", capacity_bytes=0, aio=SMALL) as store:
        assert not store.direct_io
        t = _data(3 * ALIGN + 7, torch.float32, 0)
        src = store.empty(t.numel(), t.dtype).copy_(t)
        store.write("k", src).result(timeout=30)
        out = store.empty(t.numel(), t.dtype)
        store.read("k", out).result(timeout=30)
        assert _same(out, t)


def test_direct_io_refused_at_run_time_falls_back(store: NvmeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    direct_fd, real = store._io.direct_fd, os.preadv

    def preadv(fd: int, buffers: Any, offset: int) -> int:
        if fd == direct_fd:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    t = _data(10 * ALIGN + 3, torch.float16, 1)
    store.write("k", store.empty(t.numel(), t.dtype).copy_(t)).result(timeout=30)
    monkeypatch.setattr(os, "preadv", preadv)
    out = store.empty(t.numel(), t.dtype)
    store.read("k", out).result(timeout=30)
    assert _same(out, t) and not store.direct_io


def test_file_is_preallocated_and_grows(tmp_path: Path) -> None:
    assert NvmeStore.bytes_needed([1, ALIGN, ALIGN + 1, 0]) == 4 * ALIGN
    with NvmeStore(str(tmp_path), rank=1, purpose="grow", capacity_bytes=10_000) as store:
        assert store.path == str(tmp_path / "zeroshard-grow-rank1.swp")
        st = os.stat(store.path)
        assert st.st_size == store.capacity == 3 * ALIGN
        assert st.st_blocks * 512 >= st.st_size  # blocks allocated, not a sparse file
        store.reserve("a", 10_000)
        assert store.has("a") and not store.has("b")
        store.reserve("a", 10_000)  # same size again: a no-op
        assert store.capacity == 3 * ALIGN
        big = _data(3 * 2**20 + 5, torch.uint8, 2)
        store.write("b", big).result(timeout=30)  # does not fit: the file grows
        assert store.capacity >= 3 * ALIGN + NvmeStore.bytes_needed([big.nbytes])
        st = os.stat(store.path)
        assert st.st_size == store.capacity and st.st_blocks * 512 >= st.st_size
        small = _data(2500, torch.float32, 3)
        store.write("a", small).result(timeout=30)
        out_a, out_b = torch.empty(2500), torch.empty_like(big)
        store.read("a", out_a).result(timeout=30)
        store.read("b", out_b).result(timeout=30)
        assert _same(out_a, small) and _same(out_b, big)


def test_close_removes_files_and_is_idempotent(tmp_path: Path) -> None:
    store = NvmeStore(str(tmp_path), rank=0, purpose="c", capacity_bytes=ALIGN)
    store.write("k", torch.ones(100))
    assert sorted(os.listdir(tmp_path)) == ["zeroshard-c-rank0.swp", "zeroshard-c-rank0.swp.lock"]
    store.close()
    store.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="closed"):
        store.write("k", torch.ones(100))
    dropped = NvmeStore(str(tmp_path), rank=0, purpose="gc", capacity_bytes=ALIGN)
    del dropped
    gc.collect()
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(60)
def test_forked_child_leaves_parent_files(store: NvmeStore) -> None:
    pid = os.fork()
    if pid == 0:  # the child: run what its atexit would, then leave without pytest's teardown
        try:
            store._finalizer()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    assert os.path.exists(store.path) and os.path.exists(store.path + ".lock")
    store.write("k", torch.ones(10)).result(timeout=30)


@pytest.mark.timeout(60)
def test_interpreter_exit_removes_files(tmp_path: Path) -> None:
    code = f"""
        import torch
        from zeroshard.offload.nvme import NvmeStore
        store = NvmeStore({str(tmp_path)!r}, rank=0, purpose="exit", capacity_bytes=1 << 20)
        store.write("k", torch.ones(1000))
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(tmp_path) == []


def test_directory_errors(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match="does not exist") as e:
        NvmeStore(str(missing), rank=0, purpose="p", capacity_bytes=0)
    assert str(e.value).startswith(f"{KEY}={str(missing)!r}")
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ValueError, match="not a directory") as e:
        NvmeStore(str(a_file), rank=0, purpose="p", capacity_bytes=0, config_key="x.nvme_path")
    assert str(e.value).startswith("x.nvme_path=")


def test_unwritable_directory_via_access(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What a non-root user sees on a 0o555 directory (root, which CI runs as, bypasses permissions, so a
    # real read-only directory would not test anything there).
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    with pytest.raises(ValueError, match="not writable") as e:
        NvmeStore(str(tmp_path), rank=0, purpose="p", capacity_bytes=0)
    assert str(e.value).startswith(KEY)


def test_too_little_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 4_100_000_000, 4_100_000_000)
    )
    with pytest.raises(ValueError) as e:
        NvmeStore(str(tmp_path), rank=0, purpose="p", capacity_bytes=12_300_000_000)
    msg = str(e.value)
    assert msg.startswith(KEY) and "needs 12.3 GB" in msg and "4.1 GB" in msg and "4100000000" in msg
    assert os.listdir(tmp_path) == []  # nothing left behind
    with NvmeStore(str(tmp_path), rank=0, purpose="p", capacity_bytes=ALIGN) as store:
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12, 0))
        with pytest.raises(ValueError, match="to grow"):
            store.reserve("big", 2 * ALIGN)
        store.reserve("fits", ALIGN)  # within capacity: no space needed


def test_bad_keys_and_tensors(store: NvmeStore) -> None:
    with pytest.raises(KeyError, match="'never'"):
        store.read("never", torch.empty(4))
    store.reserve("reserved", 16)
    with pytest.raises(KeyError, match="'reserved'"):  # reserved but never written
        store.read("reserved", torch.empty(4))
    with pytest.raises(RuntimeError, match="rank 3: key 'reserved' has a region of 16 bytes"):
        store.reserve("reserved", 32)
    with pytest.raises(RuntimeError, match="region of 16 bytes"):
        store.write("reserved", torch.ones(8))
    store.write("k", torch.ones(4)).result(timeout=30)
    with pytest.raises(ValueError, match="holds 16"):
        store.read("k", torch.empty(5))
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        store.write("t", torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="block_size"):
        AioSettings(block_size=1000)
    with pytest.raises(ValueError, match="purpose"):
        NvmeStore("/tmp", rank=0, purpose="a/b", capacity_bytes=0)


def test_aio_settings_from_config() -> None:
    assert AioSettings.from_config(AioConfig()) == AioSettings()  # DeepSpeed's defaults -> ours
    assert AioSettings.from_config(None) == AioSettings()
    given = AioSettings.from_config(AioConfig(block_size=4 * 2**20, intra_op_parallelism=1))
    assert given == AioSettings(block_size=4 * 2**20, intra_op_parallelism=1)
    plain = namedtuple("plain", "block_size queue_depth intra_op_parallelism")
    assert AioSettings.from_config(plain(2**20, 16, 1)) == AioSettings(queue_depth=16)
    with pytest.raises(ValueError, match=r"aio.block_size=1000"):
        AioSettings.from_config(AioConfig(block_size=1000))


def test_stale_file_of_a_crashed_run_is_replaced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "zeroshard-opt-rank0.swp"
    path.write_bytes(b"old" * 10_000)
    Path(f"{path}.lock").write_text("999999 deadhost\n")  # nobody holds its flock
    with caplog.at_level(logging.WARNING, logger=swapfile.__name__):
        with NvmeStore(str(tmp_path), rank=0, purpose="opt", capacity_bytes=ALIGN) as store:
            assert os.path.getsize(store.path) == ALIGN
            assert Path(f"{path}.lock").read_text().split()[0] == str(os.getpid())
    assert "replacing" in caplog.text and "pid 999999 on host deadhost" in caplog.text
    assert os.listdir(tmp_path) == []


def test_same_file_twice_in_one_process(store: NvmeStore, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=rf"in use by another run \(pid {os.getpid()} "):
        NvmeStore(str(tmp_path), rank=3, purpose="test", capacity_bytes=0)
    store.write("k", torch.ones(3)).result(timeout=30)  # the first store is untouched


@pytest.mark.timeout(60)
def test_file_locked_by_a_live_process(tmp_path: Path) -> None:
    lock = tmp_path / "zeroshard-opt-rank0.swp.lock"
    holder = f"""
        import fcntl, os, sys, time
        fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{{os.getpid()}} otherhost".encode())
        print("locked", flush=True)
        time.sleep(55)
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(holder)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        with pytest.raises(RuntimeError) as e:
            NvmeStore(str(tmp_path), rank=0, purpose="opt", capacity_bytes=0, config_key="x.nvme_path")
        msg = str(e.value)
        assert f"pid {proc.pid} on host otherhost" in msg and "choose another x.nvme_path" in msg
        assert lock.exists()  # the live run's lock is left alone
    finally:
        proc.kill()
        proc.wait(timeout=10)
    with NvmeStore(str(tmp_path), rank=0, purpose="opt", capacity_bytes=0):  # the run is gone: ours now
        pass


@pytest.mark.parametrize("kind", ["write", "read"])
def test_worker_errors_surface_with_rank_and_key(
    store: NvmeStore, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    good = _data(5 * ALIGN, torch.float32, 4)
    store.write("good", good).result(timeout=30)

    def broken(*args: Any) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pwritev" if kind == "write" else "preadv", broken)
    fut = store.write("bad", good) if kind == "write" else store.read("good", torch.empty_like(good))
    with pytest.raises(RuntimeError) as e:
        fut.result(timeout=30)
    key = "bad" if kind == "write" else "good"
    pattern = rf"rank 3: NVMe {kind} of key '{key}' failed on {store.path}"
    assert e.match(pattern) and isinstance(e.value.__cause__, OSError)
    with pytest.raises(RuntimeError, match=pattern):
        store.synchronize(timeout_s=30)
    store.synchronize(timeout_s=30)  # reported once
    monkeypatch.undo()
    if kind == "write":
        with pytest.raises(RuntimeError, match="last write of key 'bad'"):
            store.read("bad", torch.empty_like(good))
    out = torch.empty_like(good)
    store.read("good", out).result(timeout=30)
    assert _same(out, good)


@pytest.mark.timeout(120)
def test_bench_quick_runs(tmp_path: Path) -> None:
    """bench/nvme_io.py --quick end to end (no timing assertions: the disk is shared)."""
    out = tmp_path / "nvme_io_quick.json"
    bench = Path(__file__).resolve().parent.parent / "bench" / "nvme_io.py"
    cmd = [
        sys.executable,
        str(bench),
        "--quick",
        "--size-gb",
        "0.02",
        "--dir",
        str(tmp_path),
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert [row["config"] for row in result["store"]] == [
        "threads=1 block=1024K qd=8",
        "threads=2 block=1024K qd=8",
    ]
    for row in result["store"]:
        assert row["write_Bps"] > 0 and row["read_Bps"] > 0
    assert sorted(os.listdir(tmp_path)) == ["nvme_io_quick.json"]  # its temp dir is gone
