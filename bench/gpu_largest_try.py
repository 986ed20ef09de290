"""One try of bench/gpu_largest.py's search, in a child process of its own: build the GPT of a given depth
with one offload setting and train it two steps; print the measurements (``RESULT {...}``) or which resource
ran out (``NOFIT {...}``). Not run by hand: bench/gpu_largest.py starts each try as
``bench/gpu_largest.py --try SETTING:LAYERS``, whose child calls :func:`try_main`. The settings (``SETTINGS``)
are defined here, beside the config each one makes. How a try builds the model, and why: bench/gpu_largest.py.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from gpu_common import numel, peak_rss, sync, zero_config  # puts the repository and examples/ on sys.path
from torch import nn

MICRO_BATCH = 1


@dataclass(frozen=True)
class Setting:
    """One setting of the search: where the optimizer state and the parameter shards live, and the bytes per
    parameter assumed (only) to choose where the search starts."""

    label: str
    optimizer: str | None
    params: str | None
    gpu_bytes: float
    host_bytes: float
    disk_bytes: float


SETTINGS = {
    "zero3_bf16": Setting("no offload (stage 3, bf16)", None, None, 16, 3, 0),
    "zero3_offload": Setting("optimizer on CPU", "cpu", None, 4, 24, 0),
    "zero3_offload_all": Setting("optimizer + parameters on CPU", "cpu", "cpu", 1, 26, 0),
    "zero3_nvme": Setting("optimizer + parameters on NVMe", "nvme", "nvme", 1, 6, 15),
}


def large_config(name: str, n_embd: int, nvme_path: str) -> dict[str, Any]:
    """Stage 3 in bf16 with the setting's offload; buckets and live parameters bounded by the width."""
    config = zero_config(name, MICRO_BATCH, nvme_path)
    zero, c2 = config["zero_optimization"], n_embd * n_embd
    zero.update(
        reduce_bucket_size=2 * c2,
        stage3_prefetch_bucket_size=8 * c2,
        stage3_max_live_parameters=24 * c2,
        stage3_max_reuse_distance=0,
        stage3_param_persistence_threshold=10 * n_embd,
    )
    if SETTINGS[name].optimizer is not None:
        zero["sub_group_size"] = 4 * c2
    return config


_NO_FIT = (
    ("CUDA out of memory", "GPU memory"),
    ("CUDA error: out of memory", "GPU or pinned host memory"),
    ("can't allocate memory", "host memory"),
    ("Cannot allocate memory", "host memory"),
    ("No space left on device", "disk"),
    ("free some space", "disk"),
    ("out of memory", "memory"),
)


def no_fit_reason(text: str) -> str | None:
    """Which resource an error message says ran out, if it is one of those."""
    return next((why for needle, why in _NO_FIT if needle in text), None)


def _error_text(err: BaseException) -> str:
    """The error and its causes, one per line."""
    lines: list[str] = []
    seen: BaseException | None = err
    while seen is not None and len(lines) < 8:
        lines.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    return "\n".join(lines)


@contextlib.contextmanager
def patterned_init() -> Iterator[None]:
    """``nn.init``'s random fills replaced by copies of one random pattern (4093 values, so rows of any
    width differ): memory-bound copies instead of drawing every value on one CPU core."""
    pattern = torch.randn(4093, generator=torch.Generator().manual_seed(0)) * 0.02
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_")
    saved = {name: getattr(nn.init, name) for name in names}

    def fill(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.no_grad():
            src = pattern.to(tensor.device, tensor.dtype)
            contiguous = tensor.is_contiguous()
            flat = tensor.view(-1) if contiguous else src.new_empty(tensor.numel())
            rows, rest = divmod(flat.numel(), src.numel())
            flat[: rows * src.numel()].view(rows, src.numel()).copy_(src.expand(rows, -1))
            flat[rows * src.numel() :].copy_(src[:rest])
            if not contiguous:
                tensor.copy_(flat.view(tensor.shape))
        return tensor

    for name in names:
        setattr(nn.init, name, fill)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def try_size(name: str, n_layer: int, model: dict[str, Any], device: str, nvme_path: str) -> dict[str, Any]:
    """Build the GPT of ``n_layer`` layers under ``zero.Init``, train two steps; the measurements."""
    from train_gpt import GPT, GPTConfig

    import zeroshard

    config = large_config(name, model["n_embd"], nvme_path)
    remote = SETTINGS[name].params or "cpu"
    start = time.perf_counter()
    torch.manual_seed(0)
    init = zeroshard.zero.Init(
        remote_device=remote, config_dict_or_path=copy.deepcopy(config), dtype=torch.bfloat16
    )
    torch.set_default_dtype(torch.bfloat16)  # each submodule is built in bf16: never in fp32, even briefly
    try:
        with patterned_init(), init:
            gpt = GPT(GPTConfig(**model, n_layer=n_layer))
    finally:
        torch.set_default_dtype(torch.float32)
    n_params = sum(numel(p) for p in gpt.parameters())
    engine, _, _, _ = zeroshard.initialize(model=gpt, config=config)
    del gpt
    built_s = time.perf_counter() - start
    t = model["block_size"]
    data = torch.randint(model["vocab_size"], (2, MICRO_BATCH, t + 1), device=engine.device)
    times, losses = [], []
    for i in range(2):
        sync(device)
        t0 = time.perf_counter()
        loss = engine(data[i, :, :-1], data[i, :, 1:])
        engine.backward(loss)
        engine.step()
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    cuda = device == "cuda"
    out = {
        "n_layer": n_layer,
        "params": n_params,
        "build_s": built_s,
        "step_s": times,
        "tokens_per_s": MICRO_BATCH * t / times[1],
        "losses": losses,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
        "gpu_bytes_after_step": (torch.cuda.memory_allocated() - data.numel() * data.element_size())
        if cuda
        else 0,
        "peak_rss_bytes": peak_rss(),
        "nvme_bytes": engine.memory_breakdown().offloaded,
    }
    phases = engine.step_breakdown() if hasattr(engine, "step_breakdown") else {}
    if phases:
        out["breakdown_s"] = {k: float(v) for k, v in phases.items()}
    engine.destroy()
    return out


def try_main(arg: str, model: dict[str, Any], device: str, nvme_path: str) -> NoReturn:
    """The child of one try: prints ``RESULT {...}``, or ``NOFIT {...}`` when a resource ran out; then exits
    at once (``os._exit``: no teardown that could hang or run out of memory again)."""
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")  # if the host runs out anyway, the kernel kills this child, not the bench
    name, n_layer = arg.rsplit(":", 1)
    try:
        result = try_size(name, int(n_layer), model, device, nvme_path)
    except BaseException as err:  # the child reports every way it ends
        text = _error_text(err)
        reason = no_fit_reason(text)
        if reason is None:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        print("NOFIT " + json.dumps({"reason": reason, "message": text[-1500:]}), flush=True)
        os._exit(3)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)
