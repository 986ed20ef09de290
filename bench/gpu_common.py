"""What bench/gpu.py (the rows) and bench/gpu_largest.py (the largest GPT per offload setting) share: a row's
ds_config, the child process each measurement runs in, what a child measures about itself, and writing the
results with their table. Not a benchmark: nothing to run.

Not bench/common.py: importing that sets ``OMP_NUM_THREADS=1`` for every child, and the offload rows step on
the CPU with all its cores. Importing this module puts the repository and ``examples/`` on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

GIB = 2**30
DS = "ds_"
# A row's name after ``zeroN_`` -> where it puts (the optimizer state, the parameter shards).
OFFLOAD = {
    "offload": ("cpu", None),
    "offload_param": (None, "cpu"),
    "offload_all": ("cpu", "cpu"),
    "nvme": ("nvme", "nvme"),
}


def zero_config(row: str, micro_batch: int, nvme_path: str | None = None) -> dict[str, Any]:
    """The ds_config of a row; ``ds_<row>`` gets its zeroshard row's, with DeepSpeed's optimizer keys."""
    deepspeed = row.startswith(DS)
    row = row.removeprefix(DS)
    stage, variant = int(row[4]), row.split("_", 1)[1]
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    on_optimizer, on_params = OFFLOAD.get(variant, (None, None))
    for key, device in (("offload_optimizer", on_optimizer), ("offload_param", on_params)):
        if device is not None:
            zero[key] = {"device": device, "pin_memory": True}
            if device == "nvme":
                zero[key]["nvme_path"] = nvme_path
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=50_000_000, stage3_param_persistence_threshold=100_000)
    params: dict[str, Any] = {"lr": 1e-4, "weight_decay": 0.01}
    if deepspeed and on_optimizer is None:
        params.update(torch_adam=True, fused=True)  # torch's fused AdamW, as zeroshard; no op to compile
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "optimizer": {"type": "AdamW", "params": params},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
    }
    if row.endswith("fp16"):
        config["fp16"] = {"enabled": True, "initial_scale_power": 12}
    else:
        config["bf16"] = {"enabled": True}
    return config


# -- in the child -----------------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _proc_bytes(path: str, key: str) -> int:
    """The ``key:`` line of a /proc file given in kB, in bytes."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in {path}")


def peak_rss() -> int:
    """This process's peak RSS in bytes (``VmHWM``; ``ru_maxrss`` would count the parent's RSS at fork)."""
    return _proc_bytes("/proc/self/status", "VmHWM")


def numel(p: nn.Parameter) -> int:
    """A parameter's elements, also while ``zero.Init`` keeps it partitioned (an empty placeholder)."""
    return int(getattr(p, "ds_numel", 0) or p.numel())


# -- in the parent ----------------------------------------------------------------------------------------


@dataclass
class Child:
    """A finished child process: exit status, output, and why the bench stopped it, if it did."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    stopped: str | None = None

    def line(self, tag: str) -> str | None:
        """The JSON after the child's last ``TAG `` line, if any."""
        lines = [x for x in self.stdout.splitlines() if x.startswith(tag + " ")]
        return lines[-1][len(tag) + 1 :] if lines else None

    def tail(self, chars: int = 3000) -> str:
        return (self.stdout[-chars // 3 :] + "\n" + self.stderr[-chars:]).strip()


def mem_available() -> int:
    """The host's ``MemAvailable`` in bytes."""
    return _proc_bytes("/proc/meminfo", "MemAvailable")


_RUNNING: set[int] = set()  # sessions of the children running now: killed with this process (on_sigterm)


def on_sigterm(signum: int, frame: Any) -> None:
    """Stopped from outside (``timeout`` in the Makefile): take the running child's session along."""
    for pid in _RUNNING:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    raise SystemExit(128 + signum)


def run_child(cmd: list[str], env: dict[str, str], timeout_s: float | None, min_available: int = 0) -> Child:
    """Run ``cmd`` in its own session with its output in files; kill the session (SIGKILL) after
    ``timeout_s`` or as soon as the host's available memory falls below ``min_available`` bytes."""
    with (
        tempfile.TemporaryFile("w+", errors="replace") as out,
        tempfile.TemporaryFile("w+", errors="replace") as err,
    ):
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, text=True, start_new_session=True)
        _RUNNING.add(proc.pid)
        stopped = None
        while proc.poll() is None:
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                stopped = "time limit"
            elif min_available and mem_available() < min_available:
                stopped = "host memory"
            if stopped is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(0.1)
        _RUNNING.discard(proc.pid)
        out.seek(0)
        err.seek(0)
        return Child(proc.returncode, out.read(), err.read(), time.monotonic() - start, stopped)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(row: str, device: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if row.startswith(DS):
        env.pop("ZEROSHARD_AS_DEEPSPEED", None)  # the real DeepSpeed, not zeroshard's tree under its name
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        if device == "cuda":
            env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # Hopper, for DeepSpeed's JIT-built ops
        else:
            env["DS_ACCELERATOR"] = "cpu"
    return env


def write_results(table: str, out: str | None, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``out`` (default bench/results/TABLE.json); print its table."""
    path = Path(out or ROOT / "bench" / "results" / f"{table}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    sys.path.insert(0, str(ROOT / "tools"))
    import benchmark_tables

    print(getattr(benchmark_tables, table)(lambda _: doc))
