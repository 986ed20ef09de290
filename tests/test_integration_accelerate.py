"""Hugging Face accelerate on zeroshard (#23 item 2): an unchanged accelerate script at world size 2 on CPU.

tests/integration_scripts/accelerate_train.py is an ordinary accelerate loop (``prepare``, ``accumulate``
with 2 micro-batches per step, ``backward``, ``clip_grad_norm_``, ``save_state``/``load_state``,
``get_state_dict``, ``unwrap_model``, ``save_model``). It runs under DeepSpeed, which the activation makes
zeroshard (``zeroshard launch``, ``ZEROSHARD_AS_DEEPSPEED=1`` with torchrun or ``accelerate launch``), at
ZeRO-2 and ZeRO-3 through a ``DeepSpeedPlugin``, a ds_config file with "auto" values and an ``accelerate
config`` file; and, as the reference, without DeepSpeed (accelerate's DDP at the same world size, same
data, same optimizer). The per-micro-batch losses (averaged over ranks), the gradient norms and the final
weights agree to 1e-4 relative; a run resumed from ``save_state`` in a fresh process equals the
uninterrupted run exactly; the ZeRO-3 consolidated weights (``get_state_dict``, ``save_model``,
``save_pretrained`` with them) equal the trained parameters element for element.

Each test starts one launcher that runs several cases in turn in the same processes (process start-up and
imports dominate on 2 cores); the cases' names are documented in the script.
"""

from __future__ import annotations

import json
import os
import site
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "integration_scripts" / "accelerate_train.py"
RTOL = 1e-4
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _env(alias: bool) -> dict[str, str]:
    drop = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ZEROSHARD_AS_DEEPSPEED")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("ACCELERATE_")}
    # The checkout first, so the processes import this zeroshard (and its alias module) whatever is installed.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env |= {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    if alias:
        # The variable acts through zeroshard_as_deepspeed.pth, which installing zeroshard puts in site dirs.
        dirs = [*site.getsitepackages(), site.getusersitepackages()]
        pth = [Path(d, "zeroshard_as_deepspeed.pth") for d in dirs]
        assert any(p.exists() for p in pth), f"install zeroshard (pip install -e .): none of {pth} exists"
        env["ZEROSHARD_AS_DEEPSPEED"] = "1"
    return env


def _run(launcher: list[str], out: Path, cases: list[str], alias: bool, timeout: float = 240) -> None:
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [*launcher, str(SCRIPT), str(out), *cases],
        cwd=out,
        env=_env(alias),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:  # the ranks' tracebacks come before the launcher's summary: show both
        tracebacks = [line for line in done.stdout.splitlines() if line.startswith("[rank")]
        pytest.fail(f"{' '.join(cases)}:\n" + "\n".join(tracebacks[-80:]) + "\n...\n" + done.stdout[-4000:])


def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _record(out: Path, case: str) -> dict:
    return json.loads((out / f"{case}.json").read_text())


def _weights(out: Path, case: str) -> dict[str, torch.Tensor]:
    # accelerate's DDP get_state_dict keeps torch.compile's wrapper in the names; DeepSpeed compiles in place.
    weights = torch.load(out / f"{case}.pt", weights_only=True)
    return {k.removeprefix("_orig_mod."): v for k, v in weights.items()}


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def _assert_weights_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, ref in want.items():
        assert got[key].shape == ref.shape and got[key].dtype == ref.dtype, f"{what}: {key}"
        # Relative in norm, per tensor: Adam turns a last-bit difference in a near-zero gradient into a
        # visible step for that one element (seen: 7e-5 of the tensor's largest element, 6e-6 in norm).
        err = (got[key] - ref).norm().item() / max(ref.norm().item(), 1e-12)
        assert err <= RTOL, f"{what}: {key} differs by {err:.2e} relative (norm)"


def _assert_matches(out: Path, case: str, ref_out: Path, ref_case: str) -> None:
    """Same losses, gradient norms, learning rates and final weights as the DDP reference."""
    got, want = _record(out, case), _record(ref_out, ref_case)
    assert got["num_processes"] == want["num_processes"] == 2
    assert got["distributed_type"] == "DistributedType.DEEPSPEED", case
    assert want["distributed_type"] == "DistributedType.MULTI_CPU", ref_case
    # 8 micro-batches a rank (7 for "short" cases), 4 optimizer steps.
    assert len(got["loss"]) == len(want["loss"]) == (7 if "short" in case else 8), case
    assert len(got["grad_norm"]) == len(want["grad_norm"]) == 4, case
    assert _rel(got["loss"], want["loss"]) <= RTOL, f"{case} losses {got['loss']} vs {want['loss']}"
    assert _rel(got["grad_norm"], want["grad_norm"]) <= RTOL, f"{case} grad norms"
    assert _rel(got["lr"], want["lr"]) <= 1e-12, f"{case} learning rates"
    assert _rel([got["eval_loss"]], [want["eval_loss"]]) <= RTOL, f"{case} evaluation loss"
    assert got["dtypes"] == want["dtypes"] == ["torch.float32"], case
    # The weights moved (the comparison below is not between two untouched models).
    assert _rel(want["loss"][-1:], want["loss"][:1]) > 1e-3
    _assert_weights_close(_weights(out, case), _weights(ref_out, ref_case), case)


def _assert_consolidated_exact(out: Path, case: str, exports: bool) -> None:
    """ZeRO-3: ``get_state_dict`` (and the files written from it) are the trained parameters, exactly.

    A tied parameter is one tensor under each of its names in ``get_state_dict`` (as ``state_dict()`` has
    it); the files may keep either name.
    """
    gathered = torch.load(out / f"{case}.gathered.pt", weights_only=True)
    consolidated = _weights(out, case)
    files = [consolidated]
    if exports:
        files += [
            load_file(out / case / "save_model" / "model.safetensors"),
            load_file(out / case / "pretrained" / "model.safetensors"),
        ]
    assert set(gathered) <= set(consolidated), case
    for tensors in files:
        for name, value in tensors.items():
            want = gathered.get(name, consolidated.get(name))
            assert want is not None and want.numel() > 0 and torch.equal(value, want), f"{case}: {name}"
        for name in set(gathered) - set(tensors):  # kept under a tied name
            assert any(torch.equal(gathered[name], v) for v in tensors.values()), f"{case}: {name} missing"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The DDP runs (no DeepSpeed, no activation): every DeepSpeed case is compared with one of these."""
    out = tmp_path_factory.mktemp("ddp")
    cases = ["mlp-ddp", "mlp-ddp-sched", "mlp-ddp-sched-shuffle", "mlp-ddp-short", "mlp-ddp-adagrad"]
    cases += ["mlp-ddp-compile", "llama-ddp", "llama-ddp-sched", "llama-ddp-tied"]
    _run(_torchrun(), out, cases, alias=False)
    return out


def test_deepspeed_plugin_zero2_zero3_match_ddp(reference: Path, tmp_path: Path) -> None:
    # Started by `zeroshard launch` (no environment variable): Accelerator(deepspeed_plugin=DeepSpeedPlugin(
    # zero_stage=2|3, gradient_accumulation_steps=2, gradient_clipping=1.0, offload_optimizer_device=...)).
    # With offload, accelerate swaps the AdamW for deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True) and
    # an Adagrad for deepspeed.ops.adagrad.DeepSpeedCPUAdagrad, built from the client's param groups.
    launcher = [sys.executable, "-m", "zeroshard.cli", "launch", "--num_gpus", "2", "--no_local_rank"]
    cases = ["mlp-z2", "mlp-z3", "mlp-z2-short", "mlp-z2-compile", "mlp-z3-compile"]
    cases += ["mlp-z2-offload", "mlp-z3-offload-sched", "mlp-z3-offload-adagrad"]
    cases += ["llama-z3-pretrained", "llama-z3-tied", "mlp-z2-fp16-sched", "mlp-z3-fp16-sched"]
    _run(launcher, tmp_path, cases, alias=False)
    _assert_matches(tmp_path, "mlp-z2", reference, "mlp-ddp")
    _assert_matches(tmp_path, "mlp-z3", reference, "mlp-ddp")
    # The data ends the last accumulation window after one micro-batch: accelerate syncs there (both ways).
    _assert_matches(tmp_path, "mlp-z2-short", reference, "mlp-ddp-short")
    _assert_matches(tmp_path, "mlp-z2-offload", reference, "mlp-ddp")
    _assert_matches(tmp_path, "mlp-z3-offload-sched", reference, "mlp-ddp-sched")
    _assert_matches(tmp_path, "mlp-z3-offload-adagrad", reference, "mlp-ddp-adagrad")
    assert _record(tmp_path, "mlp-z2")["optimizer"] == "AdamW"
    assert _record(tmp_path, "mlp-z2-offload")["optimizer"] == "DeepSpeedCPUAdam"
    assert _record(tmp_path, "mlp-z3-offload-adagrad")["optimizer"] == "DeepSpeedCPUAdagrad"
    # Accelerator(dynamo_backend=...): accelerate calls engine.compile(backend=..., compile_kwargs=...).
    for case in ("mlp-z2-compile", "mlp-z3-compile"):
        assert _record(tmp_path, case)["engine_compiled"], case
        _assert_matches(tmp_path, case, reference, "mlp-ddp-compile")
    # from_pretrained under zero3_init_flag builds the model partitioned (deepspeed.zero.Init) and loads the
    # saved weights into the shards: training from there equals DDP from the same weights.
    assert _record(tmp_path, "llama-z3-pretrained")["built_partitioned"]
    _assert_matches(tmp_path, "llama-z3-pretrained", reference, "llama-ddp")
    # Tied input/output embeddings: get_state_dict has both names, one tensor (as state_dict() has them).
    _assert_matches(tmp_path, "llama-z3-tied", reference, "llama-ddp-tied")
    tied = _weights(tmp_path, "llama-z3-tied")
    assert torch.equal(tied["lm_head.weight"], tied["model.embed_tokens.weight"])
    for case in ("mlp-z3", "mlp-z3-offload-sched", "mlp-z3-compile", "llama-z3-pretrained", "llama-z3-tied"):
        _assert_consolidated_exact(tmp_path, case, exports=False)
    # fp16 (Accelerator(mixed_precision="fp16")): the first steps overflow at the initial loss scale 2**16
    # and are skipped. accelerate sees it (optimizer.overflow) and holds the LambdaLR back on exactly those
    # steps; the grad norm of a skipped step is inf, as DeepSpeed reports it.
    z2, z3 = _record(tmp_path, "mlp-z2-fp16-sched"), _record(tmp_path, "mlp-z3-fp16-sched")
    assert _rel(z3["loss"], z2["loss"]) <= 1e-3 and z2["skipped"] == z3["skipped"], "fp16 at stages 2 and 3"
    assert True in z2["skipped"] and False in z2["skipped"], z2["skipped"]
    for skipped, norm, before, after in zip(
        z2["skipped"], z2["grad_norm"], z2["lr"], z2["lr_after"], strict=True
    ):
        assert (after == before) == skipped and (norm == float("inf")) == skipped, z2


def test_ds_config_file_with_auto_values_matches_ddp(reference: Path, tmp_path: Path) -> None:
    # ZEROSHARD_AS_DEEPSPEED=1 torchrun; DeepSpeedPlugin(hf_ds_config="ds_config.json") whose batch sizes,
    # accumulation, clipping and bucket sizes are "auto"; a LambdaLR through accelerate; the "dummy" case
    # takes its AdamW from the config's optimizer block (DummyOptim, lr and weight_decay "auto").
    cases = ["llama-z2file-sched", "llama-z3file-sched-export", "llama-z3file-dummy"]
    cases += ["llama-z2file-bf16", "llama-z3file-bf16"]
    _run(_torchrun(), tmp_path, cases, alias=True)
    _assert_matches(tmp_path, "llama-z2file-sched", reference, "llama-ddp-sched")
    _assert_matches(tmp_path, "llama-z3file-sched-export", reference, "llama-ddp-sched")
    _assert_matches(tmp_path, "llama-z3file-dummy", reference, "llama-ddp")
    _assert_consolidated_exact(tmp_path, "llama-z3file-sched-export", exports=True)
    _assert_consolidated_exact(tmp_path, "llama-z3file-dummy", exports=False)
    # Accelerator(mixed_precision="bf16") adds a bf16 block to the ds_config: bf16 compute and consolidated
    # weights over fp32 masters; close to the fp32 run, and the same at both stages.
    z2, z3 = _record(tmp_path, "llama-z2file-bf16"), _record(tmp_path, "llama-z3file-bf16")
    fp32 = _record(reference, "llama-ddp")
    assert z2["dtypes"] == z3["dtypes"] == ["torch.bfloat16"]
    assert _rel(z3["loss"], z2["loss"]) <= 1e-3 and _rel(z3["loss"], fp32["loss"]) <= 1e-2
    _assert_consolidated_exact(tmp_path, "llama-z3file-bf16", exports=False)


def test_save_state_load_state_resume_exactly(reference: Path, tmp_path: Path) -> None:
    # save_state after 2 of 4 optimizer steps (and go on); then, in fresh processes, load_state, skip the
    # consumed batches and finish: the last 2 steps' losses and the final weights equal the uninterrupted
    # run's exactly (the engine's sharded checkpoint, accelerate's scheduler, RNG and sampler states; the
    # mlp's loader shuffles).
    saves = ["mlp-z3-sched-shuffle-save2", "llama-z2file-sched-save2"]
    _run(_torchrun(), tmp_path, saves, alias=True)
    _run(_torchrun(), tmp_path, [s.replace("save", "resume") for s in saves], alias=True)
    _assert_matches(tmp_path, "mlp-z3-sched-shuffle-save2", reference, "mlp-ddp-sched-shuffle")
    _assert_matches(tmp_path, "llama-z2file-sched-save2", reference, "llama-ddp-sched")
    for save in saves:
        resumed, whole = _record(tmp_path, save.replace("save", "resume")), _record(tmp_path, save)
        assert resumed["loss"] == whole["loss"][4:] and len(resumed["loss"]) == 4, save
        assert resumed["grad_norm"] == whole["grad_norm"][2:] and resumed["lr"] == whole["lr"][2:], save
        got, want = _weights(tmp_path, save.replace("save", "resume")), _weights(tmp_path, save)
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), save


ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {ds_config}
  zero3_init_flag: true
machine_rank: 0
main_training_function: main
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""


def test_accelerate_launch_with_an_accelerate_config_file(reference: Path, tmp_path: Path) -> None:
    # `accelerate launch --config_file acc.yaml` (the file `accelerate config` writes, pointing at a
    # ds_config with "auto" values, ZeRO-3, zero3_init_flag); the script calls plain Accelerator().
    ds_config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }
    (tmp_path / "ds_config.json").write_text(json.dumps(ds_config))
    (tmp_path / "acc.yaml").write_text(ACCELERATE_CONFIG.format(ds_config=tmp_path / "ds_config.json"))
    accelerate = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(tmp_path / "acc.yaml"),
    ]
    launcher = [*accelerate, "--main_process_port", str(_free_port())]
    _run(launcher, tmp_path, ["llama-launch-sched", "llama-launch-pretrained-export"], alias=True)
    _assert_matches(tmp_path, "llama-launch-sched", reference, "llama-ddp-sched")
    assert _record(tmp_path, "llama-launch-pretrained-export")["built_partitioned"]
    _assert_matches(tmp_path, "llama-launch-pretrained-export", reference, "llama-ddp")
    _assert_consolidated_exact(tmp_path, "llama-launch-pretrained-export", exports=True)


# -- the names accelerate reaches for, in this process (no alias needed: zeroshard.deepspeed directly) -------


def test_cpu_optimizers_accelerate_swaps_in_take_the_torch_step() -> None:
    # accelerate's map_pytorch_optim_to_deepspeed: the client's param groups, lr/weight_decay and
    # adamw_mode=False; the swapped-in optimizer must step as the one it replaces.
    from zeroshard.deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from zeroshard.deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
    from zeroshard.optimizers import Lion

    def run(make: Callable[..., torch.optim.Optimizer], **kwargs: Any) -> torch.Tensor:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(7, 3))
        opt = make([p], **kwargs)
        for i in range(3):
            p.grad = torch.sin(p.detach() * (i + 1))
            opt.step()
        return p.detach()

    torch_adagrad = torch.optim.Adagrad(
        [torch.nn.Parameter(torch.zeros(1))], lr=0.1, weight_decay=0.01, lr_decay=0.001
    )
    groups = torch_adagrad.param_groups  # what accelerate hands over: the torch optimizer's own groups
    swapped = DeepSpeedCPUAdagrad(groups, lr=0.1, weight_decay=0.01, adamw_mode=False)
    assert swapped.param_groups[0]["lr_decay"] == 0.001
    want = run(torch.optim.Adagrad, lr=0.1, weight_decay=0.01, eps=1e-10)
    assert torch.equal(run(DeepSpeedCPUAdagrad, lr=0.1, weight_decay=0.01, adamw_mode=False), want)
    want = run(Lion, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    assert torch.equal(run(DeepSpeedCPULion, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1), want)
    assert torch.equal(run(FusedLion, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1), want)
    with pytest.raises(ValueError, match="adamw_mode=True"):
        DeepSpeedCPUAdagrad([torch.nn.Parameter(torch.zeros(1))], adamw_mode=True)
    with pytest.raises(ValueError, match="AdamW mode"):
        DeepSpeedCPULion([torch.nn.Parameter(torch.zeros(1))], adamw_mode=True)


def test_launcher_sequence_parallel_and_init_wrapper_names() -> None:
    from zeroshard.deepspeed.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )

    from zeroshard.deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
    from zeroshard.deepspeed.runtime.zero import partition_parameters as pp

    assert DEEPSPEED_ENVIRONMENT_NAME == os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    # accelerate's sequence-parallel path: an error naming the feature, not a ModuleNotFoundError.
    with pytest.raises(NotImplementedError, match="sequence parallelism"):
        UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=None, sequence_parallel_size=2)
    with pytest.raises(NotImplementedError, match="sequence parallelism"):
        UlyssesSPDataLoaderAdapter(None, sp_rank=0, sp_group=None, sp_world_size=1, device="cpu")
    with pytest.raises(TypeError):  # DeepSpeed's signature first: a call DeepSpeed rejects fails the same way
        UlyssesSPDataLoaderAdapter(None)
    # transformers' prevent_arange_dtype_change swaps this wrapper around zero.Init.
    assert pp._orig_torch_arange is torch.arange
    wrapped = pp.zero_wrapper_for_fp_tensor_constructor(torch.ones, torch.float16, torch.device("cpu"))
    assert wrapped(3).dtype == torch.float16 and wrapped(3, dtype=torch.int64).dtype == torch.int64


def test_flops_profiler_names_import_and_refuse() -> None:
    """LLaMA-Factory's FLOPs script imports DeepSpeed's profiler: the names import, a call names the
    feature and what to use instead."""
    from zeroshard.deepspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile

    with pytest.raises(NotImplementedError, match=r"FLOPs profiler.*FlopCounterMode"):
        get_model_profile(torch.nn.Linear(2, 2), input_shape=(1, 2))
    with pytest.raises(NotImplementedError, match="FLOPs profiler"):
        FlopsProfiler(torch.nn.Linear(2, 2))
