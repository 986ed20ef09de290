"""Config files in Hjson, as DeepSpeed reads them ([Note: Hjson] in config/read.py): comments, trailing
commas, unquoted keys and values load as the same config as their JSON; duplicate keys are refused as in
JSON; a file neither parser reads names the line and column of both errors."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import hjson
import pytest

from zeroshard.config import ConfigError, load_config
from zeroshard.errors import DeepSpeedConfigError

AS_JSON = {
    "train_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.95]}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}},
}

AS_HJSON = """
// DeepSpeed's own tests and many user configs are written like this
{
  train_batch_size: 8,            # a comment after a value
  "gradient_accumulation_steps": 2,
  optimizer: {
    type: AdamW
    params: {lr: 0.001, betas: [0.9, 0.95,],},
  },
  /* a block comment */
  zero_optimization: {
    stage: 2
    offload_optimizer: {
      device: none
    }
  }
}
"""


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_hjson_file_is_the_same_config_as_its_json(tmp_path: Path) -> None:
    from_json = load_config(_write(tmp_path, "a.json", json.dumps(AS_JSON)), world_size=2)
    from_hjson = load_config(_write(tmp_path, "b.json", AS_HJSON), world_size=2)
    assert from_hjson == from_json
    assert from_hjson.train_micro_batch_size_per_gpu == 2 and from_hjson.zero_optimization.stage == 2


def test_hjson_written_by_the_hjson_package_loads(tmp_path: Path) -> None:
    path = tmp_path / "c.hjson"
    with path.open("w") as f:
        hjson.dump(AS_JSON, f)
    assert load_config(str(path), world_size=2) == load_config(AS_JSON, world_size=2)


def test_hjson_in_deepspeeds_base64_form_loads() -> None:
    text = AS_HJSON[AS_HJSON.index("{") :]  # DeepSpeed's launcher encodes an object: it starts with "{"
    encoded = base64.urlsafe_b64encode(text.encode()).decode()
    assert len(encoded) > 255  # longer than a file name may be: read_source must not stat it as one
    assert load_config(encoded, world_size=2) == load_config(AS_JSON, world_size=2)


def test_duplicate_keys_are_refused_in_hjson_too(tmp_path: Path) -> None:
    path = _write(tmp_path, "d.json", '{\n  "train_batch_size": 24,\n  "train_batch_size": 24,\n}\n')
    with pytest.raises(ConfigError, match="'train_batch_size' appears twice") as info:
        load_config(path, world_size=1)
    assert isinstance(info.value, DeepSpeedConfigError)


def test_a_file_neither_json_nor_hjson_names_both_errors(tmp_path: Path) -> None:
    path = _write(tmp_path, "e.json", '{"train_batch_size": 8, "fp16": {"enabled": true}')
    with pytest.raises(ConfigError) as info:
        load_config(path, world_size=1)
    message = str(info.value)
    assert "is not valid JSON: line 1, column" in message
    assert "nor Hjson, which DeepSpeed also reads: line 1, column" in message


def test_hjson_strings_where_numbers_belong_are_type_errors(tmp_path: Path) -> None:
    # Hjson reads an unquoted NaN (or a typo) as a string; the typed fields refuse it by key.
    path = _write(tmp_path, "f.json", "{\n  train_batch_size: 8\n  gradient_clipping: NaN\n}\n")
    with pytest.raises(ConfigError, match="gradient_clipping"):
        load_config(path, world_size=1)
