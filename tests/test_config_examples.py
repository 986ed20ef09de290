"""The realistic configs in tests/configs/ load at several world sizes with the settings they state.

Each file carries its expectations in comment keys (ignored by the loader): "_expect" maps dotted
attributes of the loaded config to values at world size 2, "_warnings" lists substrings that must
appear in its warnings. Files without "_warnings" must load without any.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from zeroshard.config import ConfigWarning, ZeroshardConfig, load_config

CONFIGS = sorted((Path(__file__).parent / "configs").glob("*.json"))
HIDDEN = 64


def _context() -> dict[str, Any]:
    param = torch.nn.Parameter(torch.zeros(2))
    return {
        "hidden_size": HIDDEN,
        "model_dtype": torch.bfloat16,
        "client_optimizer": torch.optim.AdamW([param]),
    }


def _attr(cfg: ZeroshardConfig, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    return value


def test_there_are_enough_example_configs() -> None:
    assert len(CONFIGS) >= 15


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_example_config_loads_with_stated_settings(path: Path) -> None:
    raw = json.loads(path.read_text())
    for world_size in (1, 2, 4):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = load_config(path, world_size=world_size, **_context())
        messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
        assert cfg.train_batch_size == (
            cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * world_size
        )
        expected_warnings = raw.get("_warnings", [])
        if not expected_warnings:
            assert messages == []
        for needle in expected_warnings:
            assert any(needle in message for message in messages), (needle, messages)
        assert list(cfg.warnings) == messages
        if world_size == 2:
            for dotted, expected in raw["_expect"].items():
                assert _attr(cfg, dotted) == expected, dotted


def test_example_stages_and_offload_devices_are_covered() -> None:
    stages, devices, optimizers, schedulers = set(), set(), set(), set()
    for path in CONFIGS:
        raw = json.loads(path.read_text())
        zero = raw.get("zero_optimization", {})
        stages.add(zero.get("stage", 0))
        for key in ("offload_param", "offload_optimizer"):
            devices.add(zero.get(key, {}).get("device", "none"))
        optimizers.add(raw.get("optimizer", {}).get("type"))
        schedulers.add(raw.get("scheduler", {}).get("type"))
    assert stages >= {0, 1, 2, 3}
    assert devices >= {"none", "cpu", "nvme"}
    assert optimizers >= {"Adam", "AdamW", "SGD"}
    assert schedulers >= {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"}
