"""Checkpoints on live engines: round trips per stage, saving mid-accumulation, the reshard matrix.

Every run here uses one global batch of 12 samples per optimizer step, split over however many ranks and
micro-steps there are (12 divides evenly by 1, 2, 3 and 4), so runs at different world sizes train on the
same data and their results are comparable.

Tolerances: a checkpoint holds exact values, so after a load the parameters and optimizer moments must be
bit-for-bit those saved, and training on at the same world size and stage must be bit-for-bit an
uninterrupted run. At another world size or stage the ranks sum gradients in another order (~1e-7
relative) and the test_parity bound applies: |a - b| <= 1e-6 * max|b| + 1e-3 * lr * steps.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zeroshard
from tests.distributed import run_distributed
from tests.models import VOCAB, make_model, two_groups
from zeroshard.checkpoint import (
    CheckpointError,
    get_fp32_state_dict,
    load_consolidated,
    save_pretrained,
)
from zeroshard.checkpoint.common import param_shape
from zeroshard.checkpoint.export import _gather_from_masters

GLOBAL = 12  # samples per optimizer step
SEQ = 5
K = 3  # steps before the checkpoint
N = 2  # steps after it
LR = 1e-2  # the largest lr in tests.models.two_groups
Moments = dict[tuple[str, int, int], dict[str, torch.Tensor]]


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + 1)
    x = torch.randint(1, VOCAB, (GLOBAL, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)
    if step % 2 == 1:
        x[step % GLOBAL, 0] = 0  # `rare` gets a gradient on odd steps only, from one rank
    return x, y


def micro_batch(
    step: int, micro: int, rank: int, world_size: int, gas: int
) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    m = GLOBAL // (world_size * gas)
    i = (micro * world_size + rank) * m
    return x[i : i + m], y[i : i + m]


def config(
    stage: int, world_size: int, gas: int = 1, precision: str = "fp32", gather_16bit: bool = False
) -> dict[str, Any]:
    mixed: dict[str, Any] = {}
    if precision == "bf16":
        mixed = {"bf16": {"enabled": True}}
    elif precision == "fp16":  # a small initial scale that grows every 2 steps: the scaler's state moves
        mixed = {"fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 1}}
    return {
        **mixed,
        "train_batch_size": GLOBAL,
        "train_micro_batch_size_per_gpu": GLOBAL // (world_size * gas),
        "gradient_accumulation_steps": gas,
        # A few units, some parameters split between ranks; at stage 3 every module's own unit, sharded.
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 60,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": gather_16bit,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 1e-3, "warmup_num_steps": 4, "warmup_type": "linear"},
        },
    }


def build(
    stage: int,
    world_size: int,
    gas: int = 1,
    seed: int = 0,
    group: dist.ProcessGroup | None = None,
    precision: str = "fp32",
    gather_16bit: bool = False,
) -> zeroshard.ZeroshardEngine:
    model = make_model(seed)
    if stage == 3:  # `rare` runs on some ranks only: the root module, which all ranks run, gathers it
        for p in model.rare.parameters():
            zeroshard.register_external_parameter(model, p)
    cfg = config(stage, world_size, gas, precision, gather_16bit)
    engine, _, _, _ = zeroshard.initialize(
        model=model, model_parameters=two_groups(model), config=cfg, group=group
    )
    return engine


def micro_step(engine: zeroshard.ZeroshardEngine, rank: int, world_size: int) -> None:
    """One micro-step on the data the engine's own counters point at."""
    gas = engine.gradient_accumulation_steps()
    x, y = micro_batch(engine.global_steps, engine.micro_steps % gas, rank, world_size, gas)
    engine.backward(engine(x, y))
    engine.step()


def train(engine: zeroshard.ZeroshardEngine, rank: int, world_size: int, until: int) -> None:
    while engine.global_steps < until:
        micro_step(engine, rank, world_size)


def params(engine: zeroshard.ZeroshardEngine) -> dict[str, torch.Tensor]:
    """The module's state (gathered at stage 3: collective there)."""
    with engine.gathered_parameters():
        return {n: t.detach().clone() for n, t in engine.module.state_dict().items()}


def moments(engine: zeroshard.ZeroshardEngine) -> Moments:
    assert engine.optimizer is not None
    out: Moments = {}
    for sl in engine.sharded_step.slices:
        state = engine.optimizer.state.get(sl.master, {})
        start = sl.piece.param_start
        key = (sl.unit.names[sl.piece.index], start, start + sl.piece.numel)
        out[key] = {k: v.detach().clone() for k, v in state.items()}
    return out


def assert_equal_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs by {(a[name] - b[name]).abs().max()}"


def worst_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], steps: int, what: str) -> float:
    worst = 0.0
    for name in a:
        err = float((a[name] - b[name]).abs().max())
        scale = float(b[name].abs().max())
        assert err <= 1e-6 * scale + 1e-3 * LR * steps, f"{what}: {name} differs by {err} (scale {scale})"
        worst = max(worst, err / max(scale, 1e-12))
    return worst


def portable(obj: Any) -> Any:
    """Tensors as numpy arrays (recursively): torch.multiprocessing would pass tensors back from a worker
    through shared memory that disappears when the worker exits."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [portable(v) for v in obj]
    return obj


def unportable(obj: Any) -> Any:
    if type(obj).__module__ == "numpy":
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: unportable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unportable(v) for v in obj]
    return obj


def assemble(per_rank: list[Moments]) -> dict[str, dict[str, torch.Tensor]]:
    """Full per-parameter optimizer state from every rank's slices (scalars must agree)."""
    pieces: dict[str, list[tuple[int, int, dict[str, torch.Tensor]]]] = {}
    for rank_moments in per_rank:
        for (name, start, end), state in rank_moments.items():
            pieces.setdefault(name, []).append((start, end, state))
    full: dict[str, dict[str, torch.Tensor]] = {}
    for name, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        keys = set(parts[0][2])
        assert all(set(p[2]) == keys for p in parts), f"{name}: ranks disagree on state keys"
        full[name] = {}
        for key in keys:
            if parts[0][2][key].dim() == 0:
                assert all(torch.equal(p[2][key], parts[0][2][key]) for p in parts), (name, key)
                full[name][key] = parts[0][2][key]
            else:
                flat: dict[int, torch.Tensor] = {p[0]: p[2][key] for p in parts}  # stage 0: duplicates
                full[name][key] = torch.cat([flat[s] for s in sorted(flat)])
    return full


def assert_moments_equal(loaded: Moments, truth: dict[str, dict[str, torch.Tensor]], what: str) -> None:
    for (name, start, end), state in loaded.items():
        expected = truth.get(name, {})
        assert set(state) == set(expected), (
            f"{what}: {name} has state {sorted(state)}, saved {sorted(expected)}"
        )
        for key, value in state.items():
            want = expected[key] if value.dim() == 0 else expected[key][start:end]
            assert torch.equal(value, want), f"{what}: {name}[{start}:{end}] {key} differs"


# -- round trips at one world size ------------------------------------------------------------------------


def round_trip_worker(rank: int, world_size: int, root: str) -> list[float]:
    for stage in (0, 1, 2, 3):
        gas = 2
        ckpt = os.path.join(root, f"rt{stage}")
        ref = build(stage, world_size, gas)
        train(ref, rank, world_size, K + N)

        engine = build(stage, world_size, gas)
        engine.save_checkpoint(ckpt, tag="start")  # before the first step: no optimizer state yet
        train(engine, rank, world_size, K)
        micro_step(engine, rank, world_size)  # one micro-step into the next accumulation window
        saved = params(engine)
        rng_at_save = torch.get_rng_state()
        client = {"epoch": 2, "name": "run", "sizes": (3, 4), "offsets": torch.arange(3)}
        path = engine.save_checkpoint(ckpt, tag="mid", client_state=client)
        assert path == os.path.join(ckpt, "mid")
        torch.rand(5)  # move the generator on: the load must bring it back

        # Into the live engine that just saved: the partial window's gradients are dropped.
        loaded_path, loaded_client = engine.load_checkpoint(ckpt)
        assert loaded_path == path and loaded_client["epoch"] == 2 and loaded_client["sizes"] == (3, 4)
        assert torch.equal(loaded_client["offsets"], torch.arange(3))
        assert torch.equal(torch.get_rng_state(), rng_at_save)
        assert (engine.global_steps, engine.micro_steps, engine.global_samples) == (K, K * gas, K * GLOBAL)
        assert_equal_params(params(engine), saved, f"stage {stage} live reload")
        train(engine, rank, world_size, K + N)
        assert_equal_params(params(engine), params(ref), f"stage {stage} resumed in the live engine")

        for tag in ("start", "mid"):
            fresh = build(stage, world_size, gas, seed=1)
            fresh.load_checkpoint(ckpt, tag=tag)
            train(fresh, rank, world_size, K + N)
            assert_equal_params(params(fresh), params(ref), f"stage {stage} resumed from {tag!r}")
            assert fresh.lr_scheduler.state_dict() == ref.lr_scheduler.state_dict()
        if stage in (1, 2):  # sharded masters gather into exactly the resident full parameters
            for unit in engine.units:
                for i, p in enumerate(unit.params):
                    assert torch.equal(_gather_from_masters(engine, unit, i), p.detach().reshape(-1))
    return []


def errors_worker(rank: int, world_size: int, root: str) -> None:
    engine = build(2, world_size)
    train(engine, rank, world_size, 1)
    ckpt = os.path.join(root, "good")
    engine.save_checkpoint(ckpt, tag="t")
    assert engine.load_checkpoint(os.path.join(root, "empty")) == (None, None)  # no `latest`: a warning

    def broken(name: str, damage: Any) -> str:
        path = os.path.join(root, name)
        if rank == 0:
            shutil.copytree(ckpt, path)
            damage(os.path.join(path, "t"))
        dist.barrier()
        return path

    def truncate(d: str) -> None:
        f = os.path.join(d, "shard-00001-of-00002.safetensors")
        os.truncate(f, os.path.getsize(f) // 2)

    def corrupt(d: str) -> None:
        with open(os.path.join(d, "shard-00000-of-00002.safetensors"), "r+b") as f:
            f.seek(-3, os.SEEK_END)
            f.write(b"\x7f\x7f\x7f")

    cases = [
        (truncate, r"shard-00001-of-00002\.safetensors has \d+ bytes .* truncated"),
        (
            lambda d: os.remove(os.path.join(d, "shard-00000-of-00002.safetensors")),
            r"shard-00000.* is missing",
        ),
        (corrupt, r"shard-00000-of-00002\.safetensors .* not the recorded sha256"),
        (lambda d: os.remove(os.path.join(d, "metadata.json")), r"not a zeroshard checkpoint"),
    ]
    for i, (damage, message) in enumerate(cases):
        path = broken(f"bad{i}", damage)
        before = params(engine)
        with pytest.raises(CheckpointError, match=message):
            engine.load_checkpoint(path)
        assert_equal_params(params(engine), before, "a failed load changed the engine")

    # A model with another parameter set: strict loading names the difference, non-strict loads the rest.
    class Wider(type(engine.module)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.extra = torch.nn.Parameter(torch.zeros(4))

    torch.manual_seed(0)
    wider = Wider()
    other, _, _, _ = zeroshard.initialize(
        model=wider, model_parameters=two_groups(wider), config=config(2, 2)
    )
    with pytest.raises(CheckpointError, match=r"missing keys \['extra'\]"):
        other.load_checkpoint(ckpt)
    other.load_checkpoint(ckpt, load_module_strict=False)
    loaded = params(other)
    assert torch.equal(loaded.pop("extra"), torch.zeros(4))
    assert_equal_params(loaded, params(engine), "non-strict load")

    # load_module_only: weights only, no optimizer state, counters untouched.
    only = build(2, world_size, seed=1)
    only.load_checkpoint(ckpt, load_module_only=True)
    assert_equal_params(params(only), params(engine), "load_module_only")
    assert only.global_steps == 0 and only.optimizer is not None and not only.optimizer.state

    # Consolidated exports load into a fresh model with identical tensors; tied weights stay tied.
    engine.save_16bit_model(os.path.join(root, "export16"))
    save_pretrained(engine, os.path.join(root, "pretrained"), max_shard_size=400)
    if rank == 0:
        for path in (os.path.join(root, "export16", "model.safetensors"), os.path.join(root, "pretrained")):
            fresh = load_consolidated(make_model(3), path)
            assert fresh.head.weight is fresh.emb.weight
            assert_equal_params(fresh.state_dict(), params(engine), f"export {path}")
        assert os.path.isfile(os.path.join(root, "pretrained", "model.safetensors.index.json"))
        assert_equal_params(get_fp32_state_dict(ckpt), params(engine), "get_fp32_state_dict")

    # Stage 3 without stage3_gather_16bit_weights_on_model_save: the consolidated weights all the same.
    stage3 = build(3, world_size)
    assert not stage3.config.zero_optimization.gather_16bit_weights_on_model_save
    train(stage3, rank, world_size, 1)
    stage3.save_checkpoint(os.path.join(root, "stage3"))
    assert stage3.save_16bit_model(os.path.join(root, "stage3-export"), "weights.safetensors") is True
    if rank == 0:
        truth = get_fp32_state_dict(os.path.join(root, "stage3"))
        file = os.path.join(root, "stage3-export", "weights.safetensors")
        assert_equal_params(load_consolidated(make_model(3), file).state_dict(), truth, "stage-3 export")


def masters(engine: zeroshard.ZeroshardEngine) -> dict[str, torch.Tensor]:
    """Every trained parameter's fp32 master, gathered (collective at stages 1-2)."""
    return {
        name: _gather_from_masters(engine, unit, i).reshape(param_shape(unit, i)).clone()
        for unit in engine.units
        for i, name in enumerate(unit.names)
    }


def precision_worker(rank: int, world_size: int, root: str) -> None:
    """bf16 and fp16: exact round trips with the loss scaler; fp32 <-> bf16 checkpoints load both ways."""
    for precision, stage in (("bf16", 2), ("fp16", 1), ("bf16", 3)):
        ckpt = os.path.join(root, f"{precision}-{stage}")
        ref = build(stage, world_size, precision=precision)
        train(ref, rank, world_size, K + N)
        engine = build(stage, world_size, precision=precision, gather_16bit=stage == 3)
        train(engine, rank, world_size, K)
        saved = masters(engine)
        engine.save_checkpoint(ckpt)
        fresh = build(stage, world_size, seed=1, precision=precision)
        fresh.load_checkpoint(ckpt)
        assert_equal_params(masters(fresh), saved, f"{precision} masters")
        assert_equal_params(params(fresh), params(engine), f"{precision} 16-bit parameters")
        if precision == "fp16":
            assert engine.loss_scaler is not None and fresh.loss_scaler is not None
            assert engine.loss_scaler.scale > 2.0**4, "the loss scale never moved"
            assert fresh.loss_scaler.state_dict() == engine.loss_scaler.state_dict()
        train(fresh, rank, world_size, K + N)
        assert_equal_params(params(fresh), params(ref), f"{precision} resumed")
        assert_equal_params(masters(fresh), masters(ref), f"{precision} resumed masters")

        # Exports: the 16-bit weights as trained, or the fp32 masters (gathered from the shards).
        export16 = os.path.join(root, f"{precision}-{stage}-16bit")
        export32 = os.path.join(root, f"{precision}-{stage}-fp32")
        assert engine.save_16bit_model(export16)
        save_pretrained(engine, export32, dtype=torch.float32)
        trained16 = params(engine)
        if rank == 0:
            dtype16 = torch.bfloat16 if precision == "bf16" else torch.float16
            model16 = load_consolidated(make_model(3).to(dtype16), export16)
            assert_equal_params(model16.state_dict(), trained16, "16-bit export")
            model32 = load_consolidated(make_model(3), export32)
            assert_equal_params(
                {n: p for n, p in model32.named_parameters() if n in saved}, saved, "fp32 export"
            )

    # An fp32 checkpoint into a bf16 engine: exact fp32 masters, bf16 parameters cast from them; and back.
    fp32 = build(1, world_size)
    train(fp32, rank, world_size, K)
    fp32.save_checkpoint(os.path.join(root, "fp32"))
    into_bf16 = build(2, world_size, seed=1, precision="bf16")
    into_bf16.load_checkpoint(os.path.join(root, "fp32"))
    assert_equal_params(masters(into_bf16), masters(fp32), "fp32 -> bf16 masters")
    loaded = params(into_bf16)  # the engine holds frozen parameters in bf16 too: a cast of the saved fp32
    assert_equal_params(loaded, {n: t.to(loaded[n].dtype) for n, t in params(fp32).items()}, "fp32 -> bf16")
    into_fp32 = build(0, world_size, seed=1)
    into_fp32.load_checkpoint(os.path.join(root, "bf16-2"))
    bf16_truth = build(2, world_size, precision="bf16")
    bf16_truth.load_checkpoint(os.path.join(root, "bf16-2"))
    assert_equal_params(masters(into_fp32), masters(bf16_truth), "bf16 -> fp32 masters")


def round_trip_and_errors_worker(rank: int, world_size: int, root: str) -> None:
    round_trip_worker(rank, world_size, os.path.join(root, "round_trips"))
    errors_worker(rank, world_size, os.path.join(root, "errors"))
    precision_worker(rank, world_size, os.path.join(root, "precision"))


def test_round_trips_bad_checkpoints_and_exports_world_size_2(tmp_path: Any) -> None:
    run_distributed(round_trip_and_errors_worker, 2, str(tmp_path))


@pytest.fixture
def one_thread() -> Any:
    """In-process runs use one intra-op thread, as the spawned workers do: on a loaded 2-core machine
    torch's default thread pool makes a toy model's step 100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_round_trips_world_size_1_without_launcher(tmp_path: Any, one_thread: None) -> None:
    round_trip_worker(0, 1, str(tmp_path))


# -- the reshard matrix -----------------------------------------------------------------------------------
# One spawn of 4 ranks runs every world size from 2 to 4: engines at 2 and 3 run on subgroups of the
# first ranks (initialize(group=...)), which is how a world size differs from the saving one without
# paying for a spawn per world size. World size 1 runs in the test process.


def reshard_phase(
    rank: int,
    world_size: int,
    root: str,
    loads: list[tuple[str, int]],
    saves: list[int],
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Load each ``(source, stage)`` at this world size and train on; save one checkpoint per ``saves`` stage.

    Returns what the main process compares with the sources' truth: the parameters and this rank's
    optimizer slices right after each load, and the truth of each checkpoint saved.
    """
    out: dict[str, Any] = {"loaded": {}, "saved": {}}
    refs: dict[int, dict[str, torch.Tensor]] = {}
    for source, stage in loads:
        if stage not in refs:  # the uninterrupted run at this world size and stage
            ref = build(stage, world_size, group=group)
            train(ref, rank, world_size, K + N)
            refs[stage] = params(ref)
        engine = build(stage, world_size, seed=1, group=group)  # another init: all must come from the file
        engine.load_checkpoint(os.path.join(root, source))
        assert (engine.global_steps, engine.global_samples) == (K, K * GLOBAL)
        out["loaded"][f"{source}->w{world_size}s{stage}"] = {
            "params": params(engine),
            "moments": moments(engine),
            "lr": engine.get_lr(),
        }
        train(engine, rank, world_size, K + N)
        worst_error(params(engine), refs[stage], K + N, f"{source} -> stage {stage} at W={world_size}")
    for stage in saves:
        engine = build(stage, world_size, group=group)
        train(engine, rank, world_size, K)
        name = f"w{world_size}s{stage}"
        engine.save_checkpoint(os.path.join(root, name))
        out["saved"][name] = {"params": params(engine), "moments": moments(engine), "lr": engine.get_lr()}
    return out


def reshard_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2])}  # every rank must create each
    out: dict[str, Any] = {"loaded": {}, "saved": {}}

    def phase(size: int, loads: list[tuple[str, int]], saves: list[int]) -> None:
        if rank < size:
            done = reshard_phase(rank, size, root, loads, saves, groups.get(size))
            out["loaded"].update(done["loaded"])
            out["saved"].update(done["saved"])
        dist.barrier()

    phase(2, [("w1s0", 2)], [0, 1, 2])  # 1->2, stage 0->2
    phase(4, [("w2s1", 2), ("w2s0", 1)], [1, 2])  # 2->4, stages 1->2, 0->1
    phase(3, [("w4s2", 1), ("w4s1", 2), ("w2s2", 3)], [3])  # 4->3, 2->3; stages 2->1, 1->2, 2->3
    phase(2, [("w4s1", 0), ("w3s3", 1), ("w4s1", 3)], [])  # 4->2, 3->2; stages 1->0, 3->1, 1->3
    return portable(out)  # type: ignore[no-any-return]


def check_reshards(results: list[dict[str, Any]], truth: dict[str, Any]) -> None:
    """Record the truth of every checkpoint saved; check every load against its source's truth."""
    for name in {n for r in results for n in r["saved"]}:
        first = next(r["saved"][name] for r in results if name in r["saved"])
        truth[name] = {
            "params": first["params"],
            "lr": first["lr"],
            "moments": assemble([r["saved"][name]["moments"] for r in results if name in r["saved"]]),
        }
    for case in {c for r in results for c in r["loaded"]}:
        source = case.split("->")[0]
        for r in results:
            if case in r["loaded"]:
                loaded = r["loaded"][case]
                assert_equal_params(loaded["params"], truth[source]["params"], case)
                assert loaded["lr"] == truth[source]["lr"], case
                assert_moments_equal(loaded["moments"], truth[source]["moments"], case)


def test_reshard_matrix(tmp_path: Any, one_thread: None) -> None:
    """World sizes 1->2, 2->4, 4->3, 2->3, 4->2, 3->2, 2->1, 3->1 across stages 0->2, 1->2, 0->1, 2->1,
    2->3, 1->0, 3->1, 1->3, 2->0, 3->2."""
    root = str(tmp_path)
    truth: dict[str, Any] = {}
    check_reshards([reshard_phase(0, 1, root, [], [0])], truth)
    check_reshards([unportable(r) for r in run_distributed(reshard_worker, 4, root)], truth)
    # 2->1 and 3->1; stages 2->0 and 3->2
    check_reshards([reshard_phase(0, 1, root, [("w2s2", 0), ("w3s3", 2)], [])], truth)
