"""A Hugging Face Trainer script, run unchanged with and without a DeepSpeed config (test_integration_hf.py).

Usage: ``torchrun --nproc_per_node 2 hf_trainer.py CASES.json OUT.json`` (or ``zeroshard launch``, which adds
``--local_rank=N`` as DeepSpeed's launcher does). CASES.json is a list of cases, run
one after another in this process; each names its ds_config (a dict, or null for plain DDP) and what to
exercise. Rank 0 writes, per case, the per-step losses from ``log_history`` and checks it can make in
process (the weights ``from_pretrained`` loaded under ZeRO-3 against the saved file).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

VOCAB = 64


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, seq: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, VOCAB, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def tiny_tokenizer() -> Any:
    """A word-level tokenizer over VOCAB - 2 made-up words, built in code (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def run_sft(case: dict[str, Any]) -> dict[str, Any]:
    """TRL's SFTTrainer on made-up sentences of equal length (no padding: DDP and ZeRO see equal batches)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    g = torch.Generator().manual_seed(2)
    words = torch.randint(2, VOCAB, (32, 15), generator=g)
    data = Dataset.from_dict({"text": [" ".join(f"w{int(i)}" for i in row) for row in words]})
    args = SFTConfig(
        output_dir=case["output_dir"],
        per_device_train_batch_size=4,
        max_steps=case.get("steps", 4),
        logging_steps=1,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        deepspeed=case.get("ds_config"),
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_drop_last=True,
        max_length=32,
        packing=False,
        lr_scheduler_type="constant",
        bf16=False,
    )
    torch.manual_seed(0)
    trainer = SFTTrainer(
        model=LlamaForCausalLM(tiny_config()),
        args=args,
        train_dataset=data,
        processing_class=tiny_tokenizer(),
    )
    trainer.train()
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
    }


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    if case.get("sft"):
        return run_sft(case)
    out_dir = case["output_dir"]
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=case.get("batch", 4),
        gradient_accumulation_steps=case.get("gas", 1),
        max_steps=case.get("steps", 6),
        logging_steps=1,
        learning_rate=case.get("lr", 1e-3),
        weight_decay=0.01,
        max_grad_norm=case.get("clip", 1.0),
        report_to=[],
        save_strategy="steps" if case.get("save_steps") else "no",
        save_steps=case.get("save_steps") or 500,
        deepspeed=case.get("ds_config"),
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_drop_last=True,
        lr_scheduler_type="linear",
        warmup_steps=2,
        bf16=case.get("bf16", False),
        gradient_checkpointing=case.get("gradient_checkpointing", False),
        gradient_checkpointing_kwargs={"use_reentrant": False},
        save_only_model=False,
    )
    result: dict[str, Any] = {}
    torch.manual_seed(0)
    if case.get("pretrained"):
        # Under a ZeRO-3 config, TrainingArguments made transformers see ZeRO-3: from_pretrained builds the
        # model inside zero.Init and fills each shard from the file.
        model = LlamaForCausalLM.from_pretrained(case["pretrained"], torch_dtype=torch.float32)
        result["loaded_max_abs_diff"] = _diff_to_file(model, case["pretrained"])
    else:
        model = LlamaForCausalLM(tiny_config())
    if case.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=4,
                lora_alpha=8,
                target_modules=["q_proj", "v_proj"],
                lora_dropout=0.0,
                init_lora_weights="gaussian",
            ),
        )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=case.get("resume_from"))
    result["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result["grad_norms"] = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    result["global_step"] = trainer.state.global_step
    engine = trainer.model_wrapped
    result["engine"] = f"{type(engine).__module__}.{type(engine).__name__}"
    if hasattr(engine, "zero_optimization_stage"):
        result["stage"] = engine.zero_optimization_stage()
    if case.get("save_to"):
        trainer.save_model(case["save_to"])
    return result


def _diff_to_file(model: torch.nn.Module, directory: str) -> float:
    """Largest |loaded - saved| over all parameters, gathered from their shards where ZeRO-3 holds them."""
    from safetensors.torch import load_file
    from transformers.integrations import is_deepspeed_zero3_enabled

    saved = load_file(os.path.join(directory, "model.safetensors"))
    params = list(model.named_parameters())
    worst = 0.0
    if is_deepspeed_zero3_enabled():
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            for name, p in params:
                worst = max(worst, (p.detach() - saved[name]).abs().max().item())
    else:
        for name, p in params:
            worst = max(worst, (p.detach() - saved[name]).abs().max().item())
    return worst


def main() -> None:
    spec, out = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    with open(spec) as f:
        cases = json.load(f)
    results = {case["name"]: run_case(case) for case in cases}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
