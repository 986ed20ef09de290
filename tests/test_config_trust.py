"""Config files are untrusted input: non-finite numbers, out-of-range powers, non-UTF-8 bytes and absurd
nesting are config errors naming the file or key, from `zeroshard check-config` and from load_config
(what initialize calls) alike, never OverflowError / UnicodeDecodeError / RecursionError."""

from __future__ import annotations

import re
from typing import Any

import pytest

from zeroshard.cli.main import main as cli
from zeroshard.config.load import load_config

BASE = b'{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, '


def test_hostile_config_files_are_config_errors(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (
            "scale power 2**63",
            BASE + b'"fp16": {"enabled": true, "initial_scale_power": 9223372036854775808}}',
            r"fp16\.initial_scale_power: 9223372036854775808 is not allowed; expected an integer between",
        ),
        (
            "scale power negative",
            BASE + b'"fp16": {"enabled": true, "initial_scale_power": -1}}',
            r"fp16\.initial_scale_power: -1 is not allowed; expected a value >= 0",
        ),
        (
            "lr Infinity",
            BASE + b'"optimizer": {"type": "AdamW", "params": {"lr": Infinity}}}',
            r"optimizer\.params\.lr: Infinity is not allowed; expected a finite number",
        ),
        ("NaN", BASE + b'"gradient_clipping": NaN}', r"gradient_clipping: NaN is not allowed"),
        (
            "-Infinity",
            BASE + b'"gradient_clipping": -Infinity}',
            r"gradient_clipping: -Infinity is not allowed",
        ),
        ("1e400", BASE + b'"amp": {"x": [1e400]}}', r"amp\.x\[0\]: Infinity is not allowed"),
        ("not UTF-8", b'{"train_batch_size": \xff}', r"not UTF-8 text \(byte 0xff at line 1, column 22\)"),
        (
            "not UTF-8 in a key",
            BASE + b'"fp16": {"enab\xffled": true}}',
            r"fp16\.enab\\xffled: not UTF-8 text",
        ),
        (
            "nested 40 deep",
            BASE + b'"amp": ' + b"[" * 40 + b"]" * 40 + b"}",
            r"amp\[0\]\[0\].*nested deeper than",
        ),
        ("nested", b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", r"nested too deeply"),
    ]
    for i, (what, text, message) in enumerate(cases):
        path = tmp_path / f"c{i}.json"
        path.write_bytes(text)
        with pytest.raises(ValueError, match=message):
            load_config(str(path), world_size=1)
            pytest.fail(f"{what}: load_config accepted it")
        capsys.readouterr()
        status = cli(["check-config", str(path)])
        err = capsys.readouterr().err
        assert status == 1 and re.search(message, err), f"{what}: check-config gave {status}: {err}"


def test_non_finite_numbers_in_a_dict_config_are_named() -> None:
    """A config passed as a dict (the Trainer and accelerate do) can hold float('inf') where JSON cannot."""
    base: dict[str, Any] = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8}
    cases = [
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": float("inf")}}},
            r"optimizer\.params\.lr: Infinity is not allowed; expected a finite number",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": float("nan")}}},
            r"warmup_max_lr: NaN",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, float("-inf")]}}},
            r"optimizer\.params\.betas\[1\]: -Infinity is not allowed",
        ),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            load_config({**base, **extra}, world_size=1)
