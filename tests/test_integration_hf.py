"""The Hugging Face Trainer on zeroshard (#23): tests/integration_scripts/hf_trainer.py, a Trainer script that
takes ``TrainingArguments(deepspeed=...)``, runs unchanged at world size 2 under ``ZEROSHARD_AS_DEEPSPEED=1
torchrun``, at ZeRO-2 and ZeRO-3 with "auto" values, and its per-step losses (``log_history``) and saved
weights equal the same script's under plain DDP (no ``deepspeed``) at the same world size.

All cases of one launch run one after another in the same two processes (several engines per process, as
in a notebook); a second launch resumes from the checkpoints the first wrote, as a restarted job would.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

SCRIPT = Path(__file__).parent / "integration_scripts" / "hf_trainer.py"
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# No "scheduler" block: the Trainer's own schedule drives the optimizer, as it does under DDP. (DeepSpeed's
# WarmupDecayLR runs one step behind transformers' linear schedule, so a config naming it trains differently
# from DDP under DeepSpeed too.)
AUTO = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "bf16": {"enabled": "auto"},
}


def _zero(stage: int, **zero: Any) -> dict[str, Any]:
    config = copy.deepcopy(AUTO)
    config["zero_optimization"] = {"stage": stage, **zero}
    return config


Z2 = _zero(2, reduce_bucket_size="auto", overlap_comm=True, contiguous_gradients=True)
# Persistence threshold 0: the tiny model's small parameters are sharded too, as a large model's are.
Z3 = _zero(
    3,
    stage3_param_persistence_threshold=0,
    reduce_bucket_size="auto",
    stage3_prefetch_bucket_size="auto",
    stage3_gather_16bit_weights_on_model_save=True,
)
# The Trainer's usual ZeRO-3 template: every size "auto", filled from the model by the Trainer.
Z3_AUTO = _zero(
    3,
    reduce_bucket_size="auto",
    stage3_prefetch_bucket_size="auto",
    stage3_param_persistence_threshold="auto",
    stage3_gather_16bit_weights_on_model_save=True,
    sub_group_size=1e9,
)
Z3_NO_GATHER = copy.deepcopy(Z3)
Z3_NO_GATHER["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
Z3_OFFLOAD = copy.deepcopy(Z3)
Z3_OFFLOAD["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
Z3_OFFLOAD["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
Z2_OFFLOAD = copy.deepcopy(Z2)
Z2_OFFLOAD["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}


def _launch(tmp: Path, tag: str, cases: list[dict[str, Any]], launcher: str = "torchrun") -> dict[str, Any]:
    """Run ``cases`` in one launch of the script at world size 2: ``ZEROSHARD_AS_DEEPSPEED=1 torchrun`` or
    ``zeroshard launch``; rank 0's results."""
    spec, out = tmp / f"{tag}-cases.json", tmp / f"{tag}-results.json"
    spec.write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
    if launcher == "torchrun":
        env["ZEROSHARD_AS_DEEPSPEED"] = "1"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    else:
        env.pop("ZEROSHARD_AS_DEEPSPEED", None)
        command = [sys.executable, "-m", "zeroshard.cli", "launch", "--num_gpus", "2"]
    command += [str(SCRIPT), str(spec), str(out)]
    done = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, (done.stdout + done.stderr)[-8000:]
    return json.loads(out.read_text())


def _close(got: list[float], want: list[float], rtol: float) -> None:
    assert len(got) == len(want) and len(got) > 0, (got, want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= rtol * abs(w), f"step {step + 1}: {g} vs {w} (rtol {rtol})\n{got}\n{want}"


def _weights_close(got_dir: Path, want_dir: Path, rtol: float, name: str = "model.safetensors") -> None:
    got, want = load_file(str(got_dir / name)), load_file(str(want_dir / name))
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].shape == want[key].shape, (key, got[key].shape, want[key].shape)
        scale = want[key].float().abs().max().clamp(min=1e-12)
        err = ((got[key].float() - want[key].float()).abs().max() / scale).item()
        assert err <= rtol, f"{key}: max relative difference {err:.2e} > {rtol}"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(SCRIPT.parent))
    from hf_trainer import tiny_config

    path = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(tiny_config()).save_pretrained(path)
    return path


def _case(tmp: Path, name: str, ds: dict[str, Any] | str | None, **kw: Any) -> dict[str, Any]:
    return {
        "name": name,
        "output_dir": str(tmp / name),
        "ds_config": ds,
        "save_to": str(tmp / f"{name}-final"),
        **kw,
    }


def _check_engines(cases: list[dict[str, Any]], results: dict[str, Any]) -> None:
    """The ZeRO cases ran on zeroshard's engine at the stage their config names; the others did not."""
    for case in cases:
        got = results[case["name"]]
        if case["ds_config"] is None:
            assert "zeroshard" not in got["engine"], got["engine"]
        else:
            config = case["ds_config"]
            if isinstance(config, str):
                config = json.loads(Path(config).read_text())
            assert got["engine"] == "zeroshard.runtime.engine.ZeroshardEngine", got["engine"]
            assert got["stage"] == config["zero_optimization"]["stage"]


def test_trainer_zero2_zero3_equal_ddp_then_resume(tmp_path: Path, pretrained: Path) -> None:
    def case(name: str, ds: dict[str, Any] | None, **kw: Any) -> dict[str, Any]:
        return _case(tmp_path, name, ds, **kw)

    pre = {"pretrained": str(pretrained)}
    # The DDP references first: once a Trainer has run under DeepSpeed, accelerate's process-wide state keeps
    # later Trainers in the same process on DeepSpeed (so with DeepSpeed itself too).
    first = [
        case("ddp", None, save_steps=3),
        case("ddp_gas", None, gas=2, steps=4),
        case("ddp_pre", None, **pre),
        case("z2", Z2, save_steps=3),
        case("z2_gas", Z2, gas=2, steps=4),
        case("z2_offload", Z2_OFFLOAD),
        case("z2_gc", Z2, gradient_checkpointing=True),
        case("z3", Z3, save_steps=3, **pre),
        case("z3_auto", Z3_AUTO, **pre),
        case("z3_offload", Z3_OFFLOAD, **pre),
        case("z3_gc", Z3, gradient_checkpointing=True, **pre),
    ]
    results = _launch(tmp_path, "first", first)
    _check_engines(first, results)
    # Plain DDP against ZeRO: per-step loss (log_history) and the weights save_model wrote.
    for zero, ddp in [
        ("z2", "ddp"),
        ("z2_offload", "ddp"),
        ("z2_gc", "ddp"),
        ("z2_gas", "ddp_gas"),
        ("z3", "ddp_pre"),
        ("z3_auto", "ddp_pre"),
        ("z3_offload", "ddp_pre"),
        ("z3_gc", "ddp_pre"),
    ]:
        _close(results[zero]["losses"], results[ddp]["losses"], 1e-4)
        _close(results[zero]["grad_norms"], results[ddp]["grad_norms"], 1e-3)
        _weights_close(tmp_path / f"{zero}-final", tmp_path / f"{ddp}-final", 1e-4)
    # from_pretrained under ZeRO-3 filled every shard with the file's values, element for element.
    for name in ("z3", "z3_auto", "z3_offload", "z3_gc", "ddp_pre"):
        assert results[name]["loaded_max_abs_diff"] == 0.0, (name, results[name]["loaded_max_abs_diff"])
    # save_model -> from_pretrained in a fresh process (this one) gives the trained weights.
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "z3-final")
    saved = load_file(str(tmp_path / "z3-final" / "model.safetensors"))
    for key, value in reloaded.state_dict().items():
        if key in saved:
            assert torch.equal(value, saved[key]), key

    # Restarted jobs: resume_from_checkpoint at step 3 gives the steps an uninterrupted run took.
    second = [
        case("ddp_resumed", None, resume_from=str(tmp_path / "ddp" / "checkpoint-3")),
        case("z2_resumed", Z2, resume_from=str(tmp_path / "z2" / "checkpoint-3")),
        case("z3_resumed", Z3, resume_from=str(tmp_path / "z3" / "checkpoint-3"), **pre),
        case("z3_no_gather", Z3_NO_GATHER, **pre),
    ]
    resumed = _launch(tmp_path, "second", second, launcher="zeroshard launch")
    for name, whole in [("ddp_resumed", "ddp"), ("z2_resumed", "z2"), ("z3_resumed", "z3")]:
        assert resumed[name]["global_step"] == 6
        # log_history carries steps 1-3 over from the checkpoint's trainer_state.json; 4-6 are new.
        _close(resumed[name]["losses"], results[whole]["losses"], 1e-5)
        _weights_close(tmp_path / f"{name}-final", tmp_path / f"{whole}-final", 1e-5)
    # ZeRO-3 without stage3_gather_16bit_weights_on_model_save: save_model writes a checkpoint (as with
    # DeepSpeed), from which the offline reader gives the trained weights.
    from zeroshard.checkpoint import get_fp32_state_dict

    consolidated = get_fp32_state_dict(str(tmp_path / "z3_no_gather-final"))
    want = load_file(str(tmp_path / "ddp_pre-final" / "model.safetensors"))
    assert sorted(consolidated) == sorted(want)
    for key, value in want.items():
        err = ((consolidated[key] - value).abs().max() / value.abs().max()).item()
        assert err <= 1e-4, (key, err)


def test_trainer_lora_bf16_and_trl_sft(tmp_path: Path, pretrained: Path) -> None:
    """PEFT LoRA (train, save the adapter, load it back), bf16, a config given as a file path, and TRL's
    SFTTrainer (whose fused LM-head loss gathers ``lm_head.weight`` itself, in forward and in backward)."""
    z2_file = tmp_path / "ds_z2.json"
    z2_file.write_text(json.dumps(Z2))
    pre = {"pretrained": str(pretrained)}
    cases = [
        _case(tmp_path, "ddp_lora", None, lora=True, **pre),
        _case(tmp_path, "ddp_bf16", None, bf16=True, steps=4),
        _case(tmp_path, "ddp_sft", None, sft=True),
        _case(tmp_path, "z2_lora", str(z2_file), lora=True, **pre),
        _case(tmp_path, "z3_lora", Z3, lora=True, **pre),
        _case(tmp_path, "z2_bf16", Z2, bf16=True, steps=4),
        _case(tmp_path, "z3_bf16", Z3, bf16=True, steps=4),
        _case(tmp_path, "z2_sft", Z2, sft=True),
        _case(tmp_path, "z3_sft", Z3, sft=True),
    ]
    results = _launch(tmp_path, "lora", cases)
    _check_engines([c for c in cases if "sft" not in c["name"]], results)
    for zero in ("z2_lora", "z3_lora"):
        _close(results[zero]["losses"], results["ddp_lora"]["losses"], 1e-4)
        # save_model on a PeftModel writes the adapter only; the base stays as loaded.
        _weights_close(
            tmp_path / f"{zero}-final", tmp_path / "ddp_lora-final", 1e-4, "adapter_model.safetensors"
        )
        assert not (tmp_path / f"{zero}-final" / "model.safetensors").exists()
    # The adapter loads back onto the base model in a fresh process, with the trained values.
    from peft import PeftModel

    base = transformers.LlamaForCausalLM.from_pretrained(pretrained)
    adapted = PeftModel.from_pretrained(base, tmp_path / "z3_lora-final")
    saved = load_file(str(tmp_path / "z3_lora-final" / "adapter_model.safetensors"))
    loaded = {k: v for k, v in adapted.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(saved) > 0
    for key, value in saved.items():
        match = [v for k, v in loaded.items() if k.replace(".default", "") == key]
        assert len(match) == 1 and torch.equal(match[0], value), key
    # bf16 trains in 16-bit weights under ZeRO (fp32 masters) and under autocast in DDP: close, not equal.
    for zero in ("z2_bf16", "z3_bf16"):
        _close(results[zero]["losses"], results["ddp_bf16"]["losses"], 2e-2)
    for zero in ("z2_sft", "z3_sft"):
        _close(results[zero]["losses"], results["ddp_sft"]["losses"], 1e-4)
        _close(results[zero]["grad_norms"], results["ddp_sft"]["grad_norms"], 1e-3)
