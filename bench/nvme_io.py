"""NvmeStore write/read throughput against the raw direct-I/O bandwidth of the same disk.

    .venv/bin/python bench/nvme_io.py                 # 2 GB per pass, 3 interleaved rounds
    .venv/bin/python bench/nvme_io.py --quick         # 0.1 GB, one round: a smoke test (< 15 s)
    ZEROSHARD_BENCH_NVME=/mnt/nvme .venv/bin/python bench/nvme_io.py --threads 1 2 4 8

Raw bandwidth is `dd` with O_DIRECT (write: `bs=1M oflag=direct conv=fsync`, read: `bs=1M iflag=direct`),
and the same with `bs=64M` because a 1 MiB dd keeps only one request in flight; the *raw* reference is
the faster of the two per direction. Without dd, or where dd's direct I/O fails, a Python O_DIRECT loop
(or, on a filesystem without O_DIRECT, a buffered loop with fsync and dropped caches) stands in and the
output says so.

The store writes and reads the same total as a set of `--tensor-mb` tensors (like optimizer sub-groups)
from buffers made by `NvmeStore.empty`, all requests in flight at once, for every (threads, block size)
pair. A timed write ends with fsync, as dd's does. Each round makes fresh files, in the same order; the
table shows medians over rounds. Results go to `bench/results/nvme_io[_quick].json`; bench files are
deleted at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import mmap
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zeroshard.offload.nvme import AioSettings, NvmeStore  # noqa: E402

MiB = 1 << 20
DD_BLOCKS = (1, 64)  # MiB


def dd_once(path: Path, nbytes: int, bs_mib: int) -> tuple[float, float]:
    """(write, read) bytes/s of dd with O_DIRECT; raises on any failure."""
    count = nbytes // (bs_mib * MiB)
    rates = []
    for cmd in (
        ["dd", "if=/dev/zero", f"of={path}", f"bs={bs_mib}M", f"count={count}", "oflag=direct", "conv=fsync"],
        ["dd", f"if={path}", "of=/dev/null", f"bs={bs_mib}M", "iflag=direct"],
    ):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
        m = re.search(r"^(\d+) bytes.*copied, ([\d.e+-]+) s", proc.stderr, re.MULTILINE)
        if m is None:
            raise RuntimeError(f"cannot parse dd output: {proc.stderr!r}")
        rates.append(int(m.group(1)) / float(m.group(2)))
    path.unlink()
    return rates[0], rates[1]


def python_once(path: Path, nbytes: int, bs_mib: int) -> tuple[float, float, str]:
    """(write, read) bytes/s of a sequential Python loop, O_DIRECT when the filesystem allows it."""
    buf = mmap.mmap(-1, bs_mib * MiB)  # page-aligned
    try:
        flags, how = os.O_DIRECT, "python O_DIRECT loop"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | flags, 0o600)
    except OSError:
        flags, how = 0, "python buffered loop (no O_DIRECT here; fsync, then caches dropped)"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, len(buf)):
            os.pwritev(fd, [buf], off)
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - t0)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for off in range(0, nbytes, len(buf)):
            os.preadv(fd, [buf], off)
        read = nbytes / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()
    return write, read, how


def raw_round(directory: Path, nbytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for bs in DD_BLOCKS:
        path = directory / "raw.bin"
        try:
            w, r = dd_once(path, nbytes, bs)
            how = "dd"
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            path.unlink(missing_ok=True)
            w, r, how = python_once(path, nbytes, bs)
            how += f" (dd unavailable: {str(e).strip()[:120]})"
        out[f"{bs}M"] = {"write": w, "read": r, "how": how}
    return out


def store_round(directory: Path, tensors: list[torch.Tensor], aio: AioSettings) -> dict[str, Any]:
    sizes = [t.nbytes for t in tensors]
    total = sum(sizes)
    with NvmeStore(
        str(directory), rank=0, purpose="bench", capacity_bytes=NvmeStore.bytes_needed(sizes), aio=aio
    ) as store:
        t0 = time.perf_counter()
        for i, t in enumerate(tensors):
            store.write(f"t{i}", t)
        store.synchronize()
        fd = os.open(store.path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        write = total / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i, t in enumerate(tensors):
            store.read(f"t{i}", t)
        store.synchronize()
        read = total / (time.perf_counter() - t0)
        return {"write": write, "read": read, "direct_io": store.direct_io, "syscalls": store.stats.syscalls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dir",
        type=Path,
        help="directory on the disk to test (default: $ZEROSHARD_BENCH_NVME or a temp dir under /tmp)",
    )
    parser.add_argument("--size-gb", type=float, help="bytes per pass, in GB (default 2; 0.1 with --quick)")
    parser.add_argument("--tensor-mb", type=int, help="MiB per tensor (default 64; 8 with --quick)")
    parser.add_argument(
        "--block-size", type=int, nargs="+", help="aio.block_size values in bytes (default 1 MiB, 4 MiB)"
    )
    parser.add_argument(
        "--threads", type=int, nargs="+", help="aio.intra_op_parallelism values (default 1 2 4)"
    )
    parser.add_argument("--queue-depth", type=int, nargs="+", help="aio.queue_depth values (default 8)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; 1 with --quick)")
    parser.add_argument("--json", type=Path, help="output (default bench/results/nvme_io[_quick].json)")
    parser.add_argument("--quick", action="store_true", help="0.1 GB, one round, two configurations")
    args = parser.parse_args()
    size_gb = args.size_gb or (0.1 if args.quick else 2.0)
    rounds = args.rounds or (1 if args.quick else 3)
    blocks = args.block_size or ([MiB] if args.quick else [MiB, 4 * MiB])
    threads = args.threads or ([1, 2] if args.quick else [1, 2, 4])
    out_path = args.json or ROOT / "bench" / "results" / (
        "nvme_io_quick.json" if args.quick else "nvme_io.json"
    )
    tensor_bytes = min((args.tensor_mb or (8 if args.quick else 64)) * MiB, int(size_gb * 1e9) // 4 * 4)
    n_tensors = max(1, round(size_gb * 1e9 / tensor_bytes))
    total = n_tensors * tensor_bytes
    configs = [
        AioSettings(block_size=b, queue_depth=q, intra_op_parallelism=t)
        for b in blocks
        for q in args.queue_depth or [8]
        for t in threads
    ]
    name = {
        c: f"threads={c.intra_op_parallelism} block={c.block_size // 1024}K qd={c.queue_depth}"
        for c in configs
    }

    base = args.dir or os.environ.get("ZEROSHARD_BENCH_NVME")
    workdir = Path(tempfile.mkdtemp(prefix="zeroshard-nvme-bench-", dir=base or "/tmp"))
    shape = f"{n_tensors} x {tensor_bytes / MiB:.0f} MiB"
    print(f"{workdir}: {total / 1e9:.2f} GB per pass as {shape}, {rounds} round(s)")
    raw_runs: list[dict[str, Any]] = []
    store_runs: dict[AioSettings, list[dict[str, Any]]] = {c: [] for c in configs}
    try:
        probe = NvmeStore(str(workdir), rank=0, purpose="probe", capacity_bytes=0)
        tensors = []
        for i in range(n_tensors):
            t = probe.empty(tensor_bytes // 4, torch.float32)
            t.fill_(float(i))
            tensors.append(t)
        probe.close()
        for r in range(rounds):
            raw_runs.append(raw_round(workdir, total))
            line = ", ".join(
                f"dd {k}: w {v['write'] / 1e9:.2f} r {v['read'] / 1e9:.2f}" for k, v in raw_runs[-1].items()
            )
            print(f"round {r + 1}/{rounds} raw: {line} GB/s", flush=True)
            for c in configs:
                res = store_round(workdir, tensors, c)
                store_runs[c].append(res)
                rates = f"w {res['write'] / 1e9:.2f} r {res['read'] / 1e9:.2f} GB/s"
                print(f"round {r + 1}/{rounds} {name[c]}: {rates}", flush=True)
        for i, t in enumerate(tensors):  # every read landed in its own tensor
            if not bool((t == float(i)).all()):
                raise RuntimeError(f"tensor {i} read back wrong")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    raw = {
        k: {d: statistics.median(run[k][d] for run in raw_runs) for d in ("write", "read")}
        for k in raw_runs[0]
    }
    ref = {d: max(v[d] for v in raw.values()) for d in ("write", "read")}
    rows = []
    for c in configs:
        w = statistics.median(x["write"] for x in store_runs[c])
        rd = statistics.median(x["read"] for x in store_runs[c])
        rows.append({"config": name[c], "block_size": c.block_size, "queue_depth": c.queue_depth,
                     "intra_op_parallelism": c.intra_op_parallelism, "write_Bps": w, "read_Bps": rd,
                     "pct_raw_write": 100 * w / ref["write"], "pct_raw_read": 100 * rd / ref["read"],
                     "direct_io": store_runs[c][0]["direct_io"], "runs": store_runs[c]})  # fmt: skip
    head = (
        f"{'config':<32} | {'write GB/s':>10} | {'read GB/s':>9} | {'% raw write':>11} | {'% raw read':>10}"
    )
    lines = [head, "-" * len(head)]
    table = [(f"raw (dd bs={k})", v["write"], v["read"]) for k, v in raw.items()]
    table += [(row["config"], row["write_Bps"], row["read_Bps"]) for row in rows]
    for label, w, rd in table:
        pct = f"{100 * w / ref['write']:>11.0f} | {100 * rd / ref['read']:>10.0f}"
        lines.append(f"{label:<32} | {w / 1e9:>10.2f} | {rd / 1e9:>9.2f} | {pct}")
    print("\n" + "\n".join(lines))
    hows = sorted({v["how"] for run in raw_runs for v in run.values()})
    print(f"raw measured with: {'; '.join(hows)}")
    if not all(row["direct_io"] for row in rows):
        print("note: the store fell back to buffered I/O here (no O_DIRECT)")
    best = max(rows, key=lambda row: min(row["pct_raw_write"], row["pct_raw_read"]))
    ok = min(best["pct_raw_write"], best["pct_raw_read"]) >= 80
    print(f"target >= 80% of raw: {'met' if ok else 'NOT met'} by the best configuration ({best['config']})")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "directory": str(base or "/tmp"),
        "bytes_per_pass": total,
        "tensor_bytes": tensor_bytes,
        "rounds": rounds,
        "raw": raw,
        "raw_reference": ref,
        "raw_runs": raw_runs,
        "store": rows,
        "best": best["config"],
        "target_met": ok,
        "defaults": dataclasses.asdict(AioSettings()),
    }
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
