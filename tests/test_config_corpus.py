"""Acceptance: the real DeepSpeed configs in shared/ds-configs load (or fail) as DeepSpeed 0.19.6 does.

The verdicts and effective settings come from the table in shared/ds-configs/SOURCES.md. Before loading,
each config gets the "auto" filling a Hugging Face integrator applies (micro batch 2, accumulation 1,
clipping 1.0, `enabled: "auto"` -> bf16, numbers for optimizer/scheduler "auto"); "auto" inside
zero_optimization is left for zeroshard, which takes DeepSpeed's defaults without a hidden size.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from zeroshard.config import ZeroshardConfig, load_config

# A checkout with shared/ beside the repository; ZEROSHARD_DS_CONFIGS names the directory elsewhere.
CORPUS = Path(
    os.environ.get("ZEROSHARD_DS_CONFIGS") or Path(__file__).parent.parent.parent / "shared" / "ds-configs"
)
WORLD_SIZE = 2
_OPTIMIZER_FILL = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
_SCHEDULER_FILL = {"warmup_min_lr": 0, "warmup_max_lr": 1e-4, "warmup_num_steps": 10, "total_num_steps": 100}

pytestmark = pytest.mark.skipif(
    not CORPUS.is_dir(), reason=f"acceptance corpus not found at {CORPUS} (shared/ is not checked out)"
)


def _verdicts() -> dict[str, tuple[str, str]]:
    """Parses the "Expected outcome" table of SOURCES.md: file -> (verdict, settings text)."""
    text = (CORPUS / "SOURCES.md").read_text()
    section = text.split("## Expected outcome", 1)[1]
    rows = re.findall(r"^\| `([^`]+\.json)` \| (ACCEPT|REJECT) \| (.*) \|$", section, flags=re.M)
    return {name: (verdict, settings) for name, verdict, settings in rows}


VERDICTS = _verdicts() if CORPUS.is_dir() else {}


def hf_fill(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fills top-level, precision and optimizer/scheduler "auto" like the HF integration."""
    micro = cfg.get("train_micro_batch_size_per_gpu")
    if micro == "auto":
        cfg["train_micro_batch_size_per_gpu"] = micro = 2
    gas = cfg.get("gradient_accumulation_steps")
    if gas == "auto":
        cfg["gradient_accumulation_steps"] = gas = 1
    if cfg.get("train_batch_size") == "auto":
        cfg["train_batch_size"] = (micro or 2) * (gas or 1) * WORLD_SIZE
    if cfg.get("gradient_clipping") == "auto":
        cfg["gradient_clipping"] = 1.0
    for key, enabled in (("fp16", False), ("bf16", True), ("bfloat16", True)):
        block = cfg.get(key)
        if isinstance(block, dict) and block.get("enabled") == "auto":
            block["enabled"] = enabled
    for key, fill in (("optimizer", _OPTIMIZER_FILL), ("scheduler", _SCHEDULER_FILL)):
        params = (cfg.get(key) or {}).get("params") or {}
        for name, value in params.items():
            if value == "auto":
                params[name] = fill[name]
    return cfg


def _expected(settings: str) -> dict[str, Any]:
    """Effective settings named in the table row, as attribute path -> value."""
    found: dict[str, Any] = {}
    number_keys = {
        "rbs": "zero_optimization.reduce_bucket_size",
        "prefetch": "zero_optimization.prefetch_bucket_size",
        "persist": "zero_optimization.param_persistence_threshold",
        "max_live": "zero_optimization.max_live_parameters",
        "stage": "zero_optimization.stage",
        "train": "train_batch_size",
        "micro": "train_micro_batch_size_per_gpu",
        "gas": "gradient_accumulation_steps",
    }
    for short, attr in number_keys.items():
        match = re.search(rf"\b{short}=([0-9.e+]+)", settings)
        if match:
            found[attr] = match.group(1)  # compared in _matches
    for short, attr in (
        ("overlap_comm", "zero_optimization.overlap_comm"),
        ("gather16", "zero_optimization.gather_16bit_weights_on_model_save"),
    ):
        match = re.search(rf"\b{short}=(True|False)", settings)
        if match:
            found[attr] = match.group(1) == "True"
    for short, attr in (
        ("off_opt", "zero_optimization.offload_optimizer.device"),
        ("off_param", "zero_optimization.offload_param.device"),
    ):
        match = re.search(rf"\b{short}=(\w+)", settings)
        found[attr] = match.group(1) if match else "none"
    match = re.search(r"fp16=(True|False)\(isp=(\d+)\) bf16=(True|False)", settings)
    if match:
        found["fp16.enabled"] = match.group(1) == "True"
        found["fp16.initial_scale_power"] = match.group(2)
        found["bf16.enabled"] = match.group(3) == "True"
    return found


def _attr(cfg: ZeroshardConfig, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _matches(actual: Any, expected: Any) -> bool:
    if not isinstance(expected, str) or not re.fullmatch(r"[0-9.e+]+", expected):
        return bool(actual == expected)
    if "e" in expected:  # the table prints large numbers with 3 significant digits
        return float(f"{actual:.3g}") == float(expected)
    return bool(actual == int(expected))


def _rejected_keys(settings: str) -> list[str]:
    """Keys a rejection message must name, derived from the reason in the table."""
    if settings.startswith("compile:"):
        return ["compile.disable", "compile.backend"]
    if "non-positive batch values" in settings and "m=0" in settings:
        return ["train_micro_batch_size_per_gpu"]
    if "train_batch_size or train_micro_batch_size_per_gpu" in settings:
        return ["train_batch_size", "train_micro_batch_size_per_gpu"]
    raise AssertionError(f"no expected key known for rejection reason: {settings[:80]}")


def test_table_covers_every_config() -> None:
    files = sorted(path.name for path in CORPUS.glob("*.json"))
    assert sorted(VERDICTS) == files
    assert len(files) == 40
    assert sum(verdict == "ACCEPT" for verdict, _ in VERDICTS.values()) == 36


@pytest.mark.parametrize("name", sorted(VERDICTS))
def test_corpus_config(name: str) -> None:
    verdict, settings = VERDICTS[name]
    cfg = hf_fill(json.loads((CORPUS / name).read_text()))
    if verdict == "REJECT":
        with pytest.raises((ValueError, TypeError)) as info:
            load_config(cfg, world_size=WORLD_SIZE)
        for key in _rejected_keys(settings):
            assert key in str(info.value), (key, str(info.value))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_config(cfg, world_size=WORLD_SIZE)
    expected = _expected(settings)
    assert len(expected) >= 12, settings
    for attr, value in expected.items():
        assert _matches(_attr(loaded, attr), value), (attr, _attr(loaded, attr), settings)
