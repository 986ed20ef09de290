"""``save_checkpoint(async_save=True)``: a background write that publishes at the next wait point.

One spawn at world size 2 sweeps the sub-cases (equal to a synchronous save bit for bit, a copy that
training cannot change, a later save reusing the first one's host buffers, the next save waits,
``latest`` moves only once every file is durable, a failure surfaces at the next wait naming the file,
the config switch); then a SIGKILL of a rank during the background write, and an interpreter exit with
the write still in flight (two real interpreters, since spawned workers skip ``atexit``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch

import zeroshard
import zeroshard.checkpoint.save as save_module
from tests.distributed import run_distributed
from tests.models import make_model, two_groups
from tests.test_checkpoint import assert_equal_params, build, config, params, train
from zeroshard.checkpoint import CheckpointError, get_fp32_state_dict
from zeroshard.checkpoint.format import read_latest, stale_temp_dirs
from zeroshard.checkpoint.tensorfile import sha256_file
from zeroshard.checkpoint.verify import verify_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _gate_writes(gate: threading.Event) -> None:
    """Make every checkpoint file write (on the background thread) wait for ``gate``."""
    original = save_module.write_tensors

    def gated(path: str, *args: Any, **kwargs: Any) -> Any:
        gate.wait(timeout=60)
        return original(path, *args, **kwargs)

    save_module.write_tensors = gated  # type: ignore[assignment]


def _shards(directory: str) -> dict[str, str]:
    return {
        n: sha256_file(os.path.join(directory, n)) for n in os.listdir(directory) if n.startswith("shard")
    }


def _equal_to_sync(engine: Any, rank: int, world_size: int, root: str) -> None:
    """Async save == sync save, bit for bit, although training changes the shards during the write."""
    engine.save_checkpoint(os.path.join(root, "sync"), tag="t")
    truth = params(engine)
    gate = threading.Event()
    original = save_module.write_tensors
    _gate_writes(gate)
    try:
        engine.save_checkpoint(os.path.join(root, "async"), tag="t", async_save=True)
        train(engine, rank, world_size, 4)  # mutates the masters and moments the writer is holding
        gate.set()
        published = engine.wait_for_checkpoint()
    finally:
        save_module.write_tensors = original  # type: ignore[assignment]
    assert published == os.path.join(root, "async", "t")
    assert _shards(os.path.join(root, "sync", "t")) == _shards(os.path.join(root, "async", "t"))
    assert_equal_params(get_fp32_state_dict(os.path.join(root, "async")), truth, "the async checkpoint")
    fresh = build(2, world_size)
    fresh.load_checkpoint(os.path.join(root, "async"))
    assert_equal_params(params(fresh), truth, "a load of the async checkpoint")
    assert fresh.global_steps == 2
    engine.comm.barrier()
    if rank == 0:  # a damaged file of an async checkpoint is detected as of any other
        shard = os.path.join(root, "async", "t", "shard-00001-of-00002.safetensors")
        with open(shard, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 1]))
        with pytest.raises(CheckpointError, match=r"shard-00001-of-00002\.safetensors has the recorded size"):
            verify_checkpoint(os.path.join(root, "async"))


def _steady_state_reuses_buffers(engine: Any, rank: int, world_size: int, root: str) -> None:
    """A later async save copies into the buffers of the first (no allocation) and still equals a sync save,
    although the training steps since the previous write changed every value in them."""
    host = engine.__dict__["_checkpoint_writer"].host.shard
    first = (host.allocations, host.buffer.data_ptr())
    train(engine, rank, world_size, engine.global_steps + 1)
    engine.save_checkpoint(os.path.join(root, "sync2"), tag="t")
    engine.save_checkpoint(os.path.join(root, "async2"), tag="t", async_save=True)
    train(engine, rank, world_size, engine.global_steps + 2)  # overwrites the masters the write reads from
    assert engine.wait_for_checkpoint() == os.path.join(root, "async2", "t")
    assert (host.allocations, host.buffer.data_ptr()) == first
    assert _shards(os.path.join(root, "sync2", "t")) == _shards(os.path.join(root, "async2", "t"))


def _latest_waits_for_durable(engine: Any, rank: int, root: str) -> None:
    """``latest`` keeps naming the previous checkpoint until every rank's write finished and was published;
    the next save waits for the previous one and publishes it first."""
    ckpt = os.path.join(root, "gated")
    engine.save_checkpoint(ckpt, tag="A")
    gate = threading.Event()
    original = save_module.write_tensors
    _gate_writes(gate)
    try:
        engine.save_checkpoint(ckpt, tag="B", async_save=True)
        time.sleep(0.5)
        assert read_latest(ckpt) == "A" and not os.path.exists(os.path.join(ckpt, "B"))
        engine.comm.barrier()
        gate.set()
        time.sleep(0.5)  # written now, but not published before a wait point
        assert read_latest(ckpt) == "A" and not os.path.exists(os.path.join(ckpt, "B"))
        engine.comm.barrier()
        engine.save_checkpoint(ckpt, tag="C", async_save=True)  # waits for B and publishes it
        assert read_latest(ckpt) == "B" and os.path.isdir(os.path.join(ckpt, "B"))
        engine.load_checkpoint(ckpt, tag="C")  # a load waits too: C is loadable
        assert read_latest(ckpt) == "C"
    finally:
        save_module.write_tensors = original  # type: ignore[assignment]
    assert engine.wait_for_checkpoint() is None  # nothing in flight


def _failure_names_the_file(engine: Any, rank: int, root: str) -> None:
    """Rank 1's background write fails: the next wait raises on every rank, naming rank 1 and its file."""
    ckpt = os.path.join(root, "failing")
    engine.save_checkpoint(ckpt, tag="A")
    original = save_module.write_tensors

    def full_disk(path: str, *args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    if rank == 1:
        save_module.write_tensors = full_disk  # type: ignore[assignment]
    try:
        engine.save_checkpoint(ckpt, tag="B", async_save=True)  # returns: the write fails later
        with pytest.raises(
            CheckpointError, match=r"rank 1: writing .*shard-00001-of-00002\.safetensors.*space"
        ):
            engine.wait_for_checkpoint()
    finally:
        save_module.write_tensors = original  # type: ignore[assignment]
    engine.comm.barrier()
    assert read_latest(ckpt) == "A" and stale_temp_dirs(ckpt) == []
    engine.save_checkpoint(ckpt, tag="C", async_save=True)  # the engine saves again afterwards
    assert engine.wait_for_checkpoint() == os.path.join(ckpt, "C")


def _config_switch(rank: int, world_size: int, root: str) -> None:
    """``checkpoint.writer.decoupled: true`` makes ``save_checkpoint`` asynchronous by default."""
    cfg = config(2, world_size, 1, "fp32", False)
    cfg["checkpoint"] = {"writer": {"decoupled": True}}
    model = make_model(0)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=two_groups(model), config=cfg)
    train(engine, rank, world_size, 1)
    ckpt = os.path.join(root, "switch")
    gate = threading.Event()
    original = save_module.write_tensors
    _gate_writes(gate)
    try:
        engine.save_checkpoint(ckpt, tag="A")
        assert read_latest(ckpt) is None  # in flight
        gate.set()
    finally:
        save_module.write_tensors = original  # type: ignore[assignment]
    assert engine.wait_for_checkpoint() == os.path.join(ckpt, "A") and read_latest(ckpt) == "A"
    engine.save_checkpoint(ckpt, tag="B", async_save=False)  # the argument wins over the config
    assert read_latest(ckpt) == "B"
    with pytest.raises(ValueError, match=r"async_save=\.\.\.\) applies to format=.zeroshard. only"):
        engine.save_checkpoint(ckpt, tag="D", format="deepspeed", async_save=True)


def sub_cases_worker(rank: int, world_size: int, root: str) -> None:
    engine = build(2, world_size)
    train(engine, rank, world_size, 2)
    _equal_to_sync(engine, rank, world_size, root)
    _steady_state_reuses_buffers(engine, rank, world_size, root)
    _latest_waits_for_durable(engine, rank, root)
    _failure_names_the_file(engine, rank, root)
    _config_switch(rank, world_size, root)


@pytest.mark.timeout(300)
def test_async_save_world_size_2(tmp_path: Path) -> None:
    run_distributed(sub_cases_worker, 2, str(tmp_path), timeout=280)


def _kill_in_background_write() -> None:
    """This rank's background thread writes half its shard, then kills the process."""
    original = save_module.write_tensors

    def write_then_die(path: str, *args: Any, **kwargs: Any) -> Any:
        original(path, *args, **kwargs)
        os.truncate(path, os.path.getsize(path) // 2)
        os.kill(os.getpid(), signal.SIGKILL)

    save_module.write_tensors = write_then_die  # type: ignore[assignment]


def kill_worker(rank: int, world_size: int, root: str) -> str:
    engine = build(2, world_size)
    train(engine, rank, world_size, 1)
    engine.save_checkpoint(root, tag="A")
    if rank == 0:
        safetensors.torch.save_file(params(engine), os.path.join(root, "..", "truth.safetensors"))
    if rank == 1:
        _kill_in_background_write()
    engine.save_checkpoint(root, tag="B", async_save=True)
    try:
        train(engine, rank, world_size, 3)
        engine.wait_for_checkpoint()
    except Exception as err:  # the survivor's collective fails when its peer dies
        return f"failed: {err}"
    raise AssertionError("the save was published although a rank was killed during its write")


@pytest.mark.timeout(180)
def test_sigkill_during_background_write(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    with pytest.raises(AssertionError, match=r"ranks \[1\] of 2 did not report .*-9"):
        run_distributed(kill_worker, 2, root, timeout=150, collective_timeout=20)
    assert read_latest(root) == "A"
    truth = safetensors.torch.load_file(str(tmp_path / "truth.safetensors"))
    assert_equal_params(get_fp32_state_dict(root), truth, "the checkpoint `latest` names after the kill")
    assert not os.path.exists(os.path.join(root, "B"))
    with pytest.raises(CheckpointError, match="does not exist"):  # the partial one is never read
        get_fp32_state_dict(root, tag="B")


EXIT_SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, {root!r})
rank, init, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
import zeroshard.checkpoint.save as save_module
from tests.test_checkpoint import build, train, params
import safetensors.torch
original = save_module.write_tensors
def slow(path, *args, **kwargs):
    time.sleep(2.0)  # the interpreter exits while this write is in flight
    return original(path, *args, **kwargs)
save_module.write_tensors = slow
engine = build(2, 2)
train(engine, rank, 2, 2)
if rank == 0:
    safetensors.torch.save_file(params(engine), os.path.join(ckpt, "..", "truth.safetensors"))
engine.save_checkpoint(ckpt, tag="last", async_save=True)
dist.barrier()
dist.destroy_process_group()  # publishing at exit needs no collective
print("returned", flush=True)
"""


@pytest.mark.timeout(180)
def test_exit_waits_for_the_background_write(tmp_path: Path) -> None:
    script = tmp_path / "exit_script.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT.format(root=str(ROOT))))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(tmp_path / "rendezvous"), str(ckpt)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=150)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert all("returned" in out for out in outputs), outputs
    assert read_latest(str(ckpt)) == "last", outputs
    truth = safetensors.torch.load_file(str(tmp_path / "truth.safetensors"))
    assert_equal_params(get_fp32_state_dict(str(ckpt)), truth, "the checkpoint published at exit")
    assert stale_temp_dirs(str(ckpt)) == []
    assert not [n for n in os.listdir(ckpt / "last") if n.startswith(".")]  # no markers published
