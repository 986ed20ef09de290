"""An ordinary Hugging Face accelerate training script, run by tests/test_integration_accelerate.py.

The loop is what accelerate's documentation teaches: ``accelerator.prepare``, ``accelerator.accumulate``,
``accelerator.backward``, ``accelerator.clip_grad_norm_`` at the sync step, ``optimizer.step``,
``scheduler.step``, ``save_state``/``load_state``, ``get_state_dict``/``unwrap_model``/``save_model``. It
never names DeepSpeed or zeroshard except through accelerate: which of DDP and DeepSpeed runs is the
case's choice of ``Accelerator`` arguments (or, for ``launch`` cases, the ``accelerate launch`` config).

Usage: ``torchrun --nproc_per_node 2 accelerate_train.py OUT CASE [CASE ...]``. Each case trains a fresh
model in this process (accelerate's state is reset between cases, as separate script runs would have it)
and rank 0 writes ``OUT/<case>.json`` (per-micro-batch losses averaged over ranks, grad norms, learning
rates) and ``OUT/<case>.pt`` (the final weights from ``accelerator.get_state_dict``). A case name is
``<model>-<how>`` plus options, e.g. ``mlp-z3-offload`` or ``llama-z2file-sched-save2``:

- model: ``mlp`` (odd sizes) or ``llama`` (tiny ``LlamaForCausalLM`` from a config);
- how: ``ddp`` (``Accelerator()`` without DeepSpeed), ``z2``/``z3`` (``DeepSpeedPlugin(zero_stage=...)``),
  ``z2file``/``z3file`` (``DeepSpeedPlugin(hf_ds_config=<json with "auto" values>)``), ``launch`` (plain
  ``Accelerator()``; ``accelerate launch --config_file`` supplies DeepSpeed);
- options: ``offload``: optimizer states on the CPU; ``adagrad``: torch Adagrad instead of AdamW;
  ``sched``: a LambdaLR; ``dummy``: the optimizer comes from the ds_config's ``optimizer`` block
  (``DummyOptim``); ``saveK``: ``save_state`` after K optimizer steps (and go on); ``resumeK``:
  ``load_state`` from the ``saveK`` run of the same case, skip the consumed batches and go on; ``export``:
  also ``save_model`` and ``unwrap_model(...).save_pretrained`` (llama); ``pretrained``: the llama comes
  from ``AutoModelForCausalLM.from_pretrained`` of its initial weights (partitioned as it is built at
  ZeRO-3); ``bf16``/``fp16``: ``Accelerator(mixed_precision=...)``; ``tied``: the llama ties its input and
  output embeddings; ``compile``: ``Accelerator(dynamo_backend="eager")``; ``shuffle``: a shuffling
  loader (accelerate seeds and saves its sampler); ``short``: 7 micro-batches a rank, so that the data
  ends the last accumulation window after one.

On a machine without a GPU, accelerate needs the process-group backend named (``InitProcessGroupKwargs``)
to run DeepSpeed on more than one process and ``cpu=True`` for DDP; on GPUs neither is needed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs, set_seed
from torch import nn

GAS = 2
MICRO = 4  # rows per rank per micro-batch
ROWS = 64  # 16 micro-batches in all: 8 per rank, 4 optimizer steps at W=2, GAS=2
LR = 0.02
HERE = Path(__file__).resolve().parent


def ds_config(stage: int, dummy: bool) -> dict:
    """The ds_config a user writes for accelerate: "auto" wherever accelerate knows the value."""
    zero: dict = {
        "stage": stage,
        "reduce_bucket_size": "auto",
        "overlap_comm": False,
    }
    if stage == 3:
        zero |= {
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": True,
        }
    config: dict = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
    }
    if dummy:
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.999], "eps": 1e-8},
        }
    return config


def build_model(kind: str, tied: bool = False) -> nn.Module:
    torch.manual_seed(7)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(7, 15), nn.Tanh(), nn.Linear(15, 3), nn.Tanh(), nn.Linear(3, 1))
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
        attn_implementation="eager",
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def load_pretrained(accelerator: Accelerator, path: Path) -> nn.Module:
    """``from_pretrained`` of the initial llama, which rank 0 saves first: under ZeRO-3 with
    ``zero3_init_flag`` (DeepSpeedPlugin's default there) it is built partitioned (``deepspeed.zero.Init``)
    and the weights are loaded into the shards."""
    from transformers import AutoModelForCausalLM

    if accelerator.is_main_process and not path.exists():
        build_model("llama").save_pretrained(str(path))
    accelerator.wait_for_everyone()
    return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager")


def dataset(kind: str, rows: int = ROWS) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(11)
    if kind == "mlp":
        x = torch.randn(ROWS, 7, generator=g)[:rows] * 2.0
        return torch.utils.data.TensorDataset(x, (x[:, :3].sum(dim=1, keepdim=True) * 1.5).sin() * 3.0)
    return torch.utils.data.TensorDataset(torch.randint(0, 64, (ROWS, 12), generator=g)[:rows])


def loss_of(kind: str, model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    if kind == "mlp":
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def make_accelerator(parts: list[str], how: str, stage: int, case_dir: Path) -> Accelerator:
    gloo = [InitProcessGroupKwargs(backend="gloo")] if not torch.cuda.is_available() else []
    # torch.compile through accelerate (engine.compile under DeepSpeed); "eager" traces without codegen.
    dynamo: dict = {"dynamo_backend": "eager"} if "compile" in parts else {}
    if how == "ddp":
        return Accelerator(gradient_accumulation_steps=GAS, cpu=not torch.cuda.is_available(), **dynamo)
    if how == "launch":  # accelerate launch --config_file <yaml with deepspeed_config_file>
        return Accelerator(gradient_accumulation_steps=GAS, kwargs_handlers=gloo, **dynamo)
    if how.endswith("file"):
        plugin = DeepSpeedPlugin(hf_ds_config=str(case_dir / "ds_config.json"))
    else:
        plugin = DeepSpeedPlugin(
            zero_stage=stage,
            gradient_accumulation_steps=GAS,
            gradient_clipping=1.0,
            offload_optimizer_device="cpu" if "offload" in parts else "none",
            zero3_save_16bit_model=True,
        )
    return Accelerator(
        deepspeed_plugin=plugin,
        gradient_accumulation_steps=GAS,
        kwargs_handlers=gloo,
        mixed_precision=next((p for p in parts if p in ("bf16", "fp16")), "no"),
        **dynamo,
    )


def gathered_parameters(accelerator: Accelerator, model: nn.Module) -> dict[str, torch.Tensor] | None:
    """At ZeRO-3, the trained parameters as ``deepspeed.zero.GatheredParameters`` shows them (rank 0)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3:
        return None
    import deepspeed

    unwrapped = accelerator.unwrap_model(model)
    with deepspeed.zero.GatheredParameters(list(unwrapped.parameters())):
        return {n: p.detach().cpu().clone() for n, p in unwrapped.named_parameters()}


def reset_accelerate(environ: dict[str, str]) -> None:
    """What a new script run starts from: no accelerate state (the process group stays), the launcher's
    environment (Accelerator sets ACCELERATE_USE_DEEPSPEED when given a plugin)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    os.environ.clear()
    os.environ.update(environ)


def option(parts: list[str], prefix: str) -> int | None:
    """K from a ``<prefix>K`` part of the case name."""
    values = [p[len(prefix) :] for p in parts if p.startswith(prefix)]
    return int(values[0]) if values and values[0].isdigit() else None


def run_case(out: Path, case: str, environ: dict[str, str]) -> None:
    parts = case.split("-")
    kind, how = parts[0], parts[1]
    stage = int(how[1]) if how[0] == "z" else 0
    sched, dummy, export = (flag in parts for flag in ("sched", "dummy", "export"))
    save_at, resume_at = option(parts, "save"), option(parts, "resume")
    base = "-".join(p for p in parts if not p.startswith(("save", "resume")))
    case_dir = out / case
    case_dir.mkdir(parents=True, exist_ok=True)
    if how.endswith("file"):
        # Every rank writes the same file: each through its own temporary name and an atomic rename, so no
        # rank can read it half written.
        tmp = case_dir / f"ds_config.json.{os.environ.get('RANK', '0')}"
        tmp.write_text(json.dumps(ds_config(stage, dummy)))
        os.replace(tmp, case_dir / "ds_config.json")

    set_seed(3)
    accelerator = make_accelerator(parts, how, stage, case_dir)
    if "pretrained" in parts:
        model = load_pretrained(accelerator, out / "init_model")
    else:
        model = build_model(kind, tied="tied" in parts)
    if dummy and how != "ddp":
        from accelerate.utils import DummyOptim  # exported only where DeepSpeed is importable

        optimizer = DummyOptim(model.parameters(), lr=LR, weight_decay=0.01)
    elif "adagrad" in parts:  # offloaded: accelerate swaps in deepspeed.ops.adagrad.DeepSpeedCPUAdagrad
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1, weight_decay=0.01)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    # "short": 7 micro-batches a rank, so the last accumulation window (ended by the data) has one.
    rows = ROWS - 2 * MICRO if "short" in parts else ROWS
    loader = torch.utils.data.DataLoader(dataset(kind, rows), batch_size=MICRO, shuffle="shuffle" in parts)
    objects = [model, optimizer, loader]
    if sched:
        # Linear decay over the optimizer steps (accelerate steps it once per process per sync step).
        total = (ROWS // MICRO // GAS) * accelerator.num_processes
        objects.append(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - 0.8 * s / total))
    # ZeRO-3 with zero3_init_flag: from_pretrained built the model partitioned (empty local parameters).
    built_partitioned = any(p.numel() == 0 for p in model.parameters())
    prepared = accelerator.prepare(*objects)
    model, optimizer, loader = prepared[:3]
    scheduler = prepared[3] if sched else None

    record: dict = {
        "loss": [],
        "grad_norm": [],
        "lr": [],
        "skipped": [],
        "lr_after": [],
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "built_partitioned": built_partitioned,
        "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,  # what accelerate wraps
        "engine_compiled": bool(getattr(model, "is_compiled", False)),  # DeepSpeed's engine.is_compiled
    }
    start = 0
    if resume_at is not None:
        accelerator.load_state(str(out / f"{base}-save{resume_at}" / "state"))
        start = resume_at * GAS
        loader = accelerator.skip_first_batches(loader, start)
    for micro, batch in enumerate(loader, start=start):
        with accelerator.accumulate(model):
            loss = loss_of(kind, model, batch)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                record["grad_norm"].append(float(norm))
                record["lr"].append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            if accelerator.sync_gradients:  # fp16: the loss scaler skips steps whose gradients overflow
                record["skipped"].append(accelerator.optimizer_step_was_skipped)
                record["lr_after"].append(optimizer.param_groups[0]["lr"])
            optimizer.zero_grad()
        record["loss"].append(accelerator.gather(loss.detach()[None]).mean().item())
        if save_at is not None and accelerator.sync_gradients and micro + 1 == save_at * GAS:
            accelerator.save_state(str(case_dir / "state"))

    # An evaluation forward, as accelerate scripts do between epochs (at ZeRO-3: gathered without backward).
    model.eval()
    with torch.no_grad():
        held_out = [t[-MICRO:].to(accelerator.device) for t in dataset(kind).tensors]
        record["eval_loss"] = accelerator.gather(loss_of(kind, model, held_out)[None]).mean().item()
    model.train()

    state_dict = accelerator.get_state_dict(model)
    record["dtypes"] = sorted({str(v.dtype) for v in state_dict.values()})
    gathered = gathered_parameters(accelerator, model)
    if accelerator.is_main_process:
        torch.save({k: v.detach().cpu().clone() for k, v in state_dict.items()}, out / f"{case}.pt")
        if gathered is not None:
            torch.save(gathered, out / f"{case}.gathered.pt")
        (out / f"{case}.json").write_text(json.dumps(record))
    if export:
        accelerator.save_model(model, str(case_dir / "save_model"))
        accelerator.unwrap_model(model).save_pretrained(
            str(case_dir / "pretrained"),
            is_main_process=accelerator.is_main_process,
            save_function=accelerator.save,
            state_dict=state_dict,
        )
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    del model, optimizer, loader, scheduler, accelerator
    reset_accelerate(environ)


def main() -> None:
    out = Path(sys.argv[1])
    environ = dict(os.environ)
    for case in sys.argv[2:]:
        run_case(out, case, environ)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
