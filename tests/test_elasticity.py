"""DeepSpeed's `elasticity` block: zeroshard's search against DeepSpeed 0.19.6's own `compute_elastic_config`
(tests/data/elasticity_reference.json, written by tools/elasticity_reference.py), and the block applied by
`load_config` and `initialize()`."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest

import zeroshard
from tests.distributed import run_distributed
from tests.models import make_model
from zeroshard.config import ConfigError, ConfigWarning, load_config
from zeroshard.deepspeed import elasticity as ds_elasticity

REFERENCE = Path(__file__).parent / "data" / "elasticity_reference.json"
BLOCK = {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [2, 4], "version": 0.1}
TRAIN, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


def _outcome(row: dict[str, Any]) -> tuple[str, Any]:
    try:
        got = ds_elasticity.compute_elastic_config(
            row["ds_config"],
            row["target"],
            world_size=row["world_size"],
            return_microbatch=row["return_microbatch"],
        )
    except Exception as err:  # compared by class below
        return "error", type(err)
    return "result", json.loads(json.dumps(got))


def _matches(row: dict[str, Any], kind: str, got: Any) -> bool:
    if "result" in row:
        return kind == "result" and got == row["result"]
    if kind != "error":
        return False
    names = [cls.__name__ for cls in got.__mro__]
    # DeepSpeed's own classes by name; a builtin (ValueError, TypeError, ...) as a base, so that code
    # catching what DeepSpeed raised catches zeroshard's more specific error too.
    return names[0] == row["error"] if row["error"].startswith("Elasticity") else row["error"] in names


def test_every_reference_row_matches_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    reference = json.loads(REFERENCE.read_text())
    assert reference["deepspeed_version"] == "0.19.6"
    rows = reference["rows"]
    assert (
        len(rows) > 500
        and sum("error" in row for row in rows) > 50
        and sum("result" in row for row in rows) > 100
    )
    wrong = []
    for index, row in enumerate(rows):
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        for key, value in row["env"].items():
            monkeypatch.setenv(key, value)
        kind, got = _outcome(row)
        if not _matches(row, kind, got):
            wrong.append(f"row {index}: {row} -> {kind} {got}")
    assert not wrong, f"{len(wrong)} rows differ from DeepSpeed 0.19.6:\n" + "\n".join(wrong[:10])


def test_public_names_and_error_types() -> None:
    for name in ("ElasticityError", "ElasticityConfigError", "ElasticityIncompatibleWorldSize"):
        cls = getattr(ds_elasticity, name)
        assert issubclass(cls, ConfigError) and issubclass(cls, ValueError), name
        assert issubclass(cls, ds_elasticity.ElasticityError)
    assert ds_elasticity.elasticity_enabled({"elasticity": BLOCK})
    assert not ds_elasticity.elasticity_enabled({"elasticity": {"enabled": False}})
    assert not ds_elasticity.elasticity_enabled({})
    assert (ds_elasticity.ELASTICITY, ds_elasticity.ENABLED, ds_elasticity.ENABLED_DEFAULT) == (
        "elasticity",
        "enabled",
        False,
    )
    with pytest.raises(ds_elasticity.ElasticityIncompatibleWorldSize, match=r"world size 5 is not allowed"):
        ds_elasticity.compute_elastic_config({"elasticity": BLOCK}, "0.19.6", world_size=5)


def _triad(cfg: dict[str, Any], world_size: int) -> tuple[int, int, int]:
    loaded = load_config(cfg, world_size=world_size)
    return loaded.train_batch_size, loaded.train_micro_batch_size_per_gpu, loaded.gradient_accumulation_steps


@pytest.mark.parametrize("version", [0.1, 0.2])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_load_config_takes_the_batch_from_the_block(version: float, world_size: int) -> None:
    block = {**BLOCK, "version": version}
    batch, _, micro = ds_elasticity.compute_elastic_config({"elasticity": block}, "0.19.6", world_size)
    assert _triad({"elasticity": block}, world_size) == (batch, micro, batch // (micro * world_size))
    assert batch == micro * world_size * (batch // (micro * world_size))


def test_batch_keys_beside_the_block() -> None:
    for key, value in ((TRAIN, 8), (MICRO, 2), (GAS, "auto")):
        with pytest.raises(
            ds_elasticity.ElasticityConfigError, match=rf"{key}: not allowed beside an enabled"
        ):
            load_config({"elasticity": BLOCK, key: value}, world_size=2)
    cfg = {"elasticity": {**BLOCK, "ignore_non_elastic_batch_info": True}, TRAIN: 8, GAS: 1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_config(cfg, world_size=2)
    assert (loaded.train_batch_size, loaded.gradient_accumulation_steps) == (48, 6)
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert any(m.startswith("train_batch_size: 8 is replaced by 48") for m in messages), messages
    assert any(m.startswith("gradient_accumulation_steps: 1 is replaced by 6") for m in messages), messages
    # A disabled block changes nothing and warns about nothing.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _triad({"elasticity": {**BLOCK, "enabled": False}, TRAIN: 8}, 2) == (8, 4, 1)
    assert not [w for w in caught if issubclass(w.category, ConfigWarning)]


@pytest.mark.parametrize(
    ("block", "error", "words"),
    [
        ({"max_train_batch_size": None}, "ElasticityConfigError", "elasticity.max_train_batch_size: missing"),
        ({"micro_batch_sizes": None}, "ElasticityConfigError", "elasticity.micro_batch_sizes: missing"),
        ({"min_gpus": 0}, "ElasticityConfigError", "elasticity.min_gpus: 0 is not allowed"),
        (
            {"min_gpus": 8, "max_gpus": 4},
            "ElasticityConfigError",
            "min_gpus: 8 is above elasticity.max_gpus 4",
        ),
        ({"micro_batch_sizes": [2, 4.5]}, "ElasticityConfigError", "elasticity.micro_batch_sizes"),
        (
            {"model_parallel_size": 2},
            "ElasticityConfigError",
            "elasticity.model_parallel_size: 2 is not allowed",
        ),
        ({"version": 0.3}, "ElasticityConfigError", "elasticity.version: 0.3 is not allowed"),
        ({"version": 0.15}, "ElasticityVersionError", "elasticity.version: 0.15 is not allowed"),
        ({"max_train_batch_size": 3}, "ElasticityConfigError", "at most max_train_batch_size 3"),
        (
            {"max_train_batch_size": 6, "micro_batch_sizes": [4], "version": 0.2},
            "ElasticityConfigError",
            "less than one",
        ),
        (
            {"num_gpus_per_node": 4, "model_parallel_size": 3, "version": 0.2},
            "ElasticityError",
            "elasticity.num_gpus_per_node: 4 is not allowed",
        ),
        ({"min_gpus": 3, "max_gpus": 3}, "ElasticityIncompatibleWorldSize", "world size 2 is not allowed"),
    ],
)
def test_errors_through_load_config(block: dict[str, Any], error: str, words: str) -> None:
    given = {key: value for key, value in {**BLOCK, **block}.items() if value is not None}
    with pytest.raises(ConfigError) as caught:
        load_config({"elasticity": given}, world_size=2)
    assert type(caught.value).__name__ == error
    assert isinstance(caught.value, ds_elasticity.ElasticityError) and isinstance(caught.value, ValueError)
    assert words in str(caught.value)
    assert "no batch size given" not in str(caught.value)  # the failed block adds no triad problem


def test_the_scheduler_config_must_match(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("DEEPSPEED_ELASTICITY_CONFIG", raising=False)
    with caplog.at_level(logging.WARNING, logger="zeroshard.config.elastic_settings"):
        assert _triad({"elasticity": BLOCK}, 2) == (48, 4, 6)
    assert "DEEPSPEED_ELASTICITY_CONFIG is not set" in caplog.text
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps({**BLOCK, "min_gpus": 2}))  # not compared
    assert _triad({"elasticity": BLOCK}, 2) == (48, 4, 6)
    ds_elasticity.ensure_immutable_elastic_config(BLOCK)
    for key, value in (("max_train_batch_size", 32), ("micro_batch_sizes", [2]), ("version", 0.2)):
        monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps({**BLOCK, key: value}))
        with pytest.raises(ds_elasticity.ElasticityConfigError, match=rf"elasticity\.{key}: .* differs from"):
            load_config({"elasticity": BLOCK}, world_size=2)
        with pytest.raises(ds_elasticity.ElasticityConfigError, match=rf"elasticity\.{key}"):
            ds_elasticity.ensure_immutable_elastic_config(BLOCK)
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", "{not json")
    with pytest.raises(
        ds_elasticity.ElasticityConfigError, match=r"DEEPSPEED_ELASTICITY_CONFIG: .* is not a valid"
    ):
        load_config({"elasticity": BLOCK}, world_size=2)


def _engine_batch(rank: int, world_size: int) -> tuple[int, int, int]:
    config = {
        "elasticity": {**BLOCK, "version": 0.2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2},
    }
    engine, _, _, _ = zeroshard.initialize(model=make_model(0), config=config)
    return (
        engine.train_batch_size(),
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
    )


@pytest.mark.timeout(240)
def test_initialize_takes_the_elastic_batch_at_world_size_1_and_2(monkeypatch: pytest.MonkeyPatch) -> None:
    block = {"elasticity": {**BLOCK, "version": 0.2}}
    expected = {}
    for world_size in (1, 2):
        batch, _, micro = ds_elasticity.compute_elastic_config(block, "0.19.6", world_size)
        expected[world_size] = (batch, micro, batch // (micro * world_size))
    assert expected[1][0] == expected[2][0]  # the same global batch at both sizes
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert _engine_batch(0, 1) == expected[1]
    assert run_distributed(_engine_batch, 2) == [expected[2], expected[2]]
