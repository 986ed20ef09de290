"""The batch triad: DeepSpeed's inference and checks of train / micro / accumulation for a world size."""

from __future__ import annotations

import itertools
import re

import pytest

from zeroshard.config import ConfigError, ConfigTypeError, load_config

TRAIN, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
KEYS = (TRAIN, MICRO, GAS)
SUBSETS = [combo for size in range(4) for combo in itertools.combinations(KEYS, size)]
WORLD_SIZES = (1, 2, 4)


def triad(cfg: dict[str, object], world_size: int) -> tuple[int, int, int]:
    loaded = load_config(cfg, world_size=world_size)
    return loaded.train_batch_size, loaded.train_micro_batch_size_per_gpu, loaded.gradient_accumulation_steps


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("given", SUBSETS, ids=lambda keys: "+".join(k.split("_")[1] for k in keys) or "none")
def test_valid_combinations(given: tuple[str, ...], world_size: int) -> None:
    micro, gas = 2, 3
    full = {TRAIN: micro * gas * world_size, MICRO: micro, GAS: gas}
    cfg = {key: full[key] for key in given}
    if TRAIN not in given and MICRO not in given:
        with pytest.raises(ConfigError, match=f"set {TRAIN} or {MICRO}"):
            triad(cfg, world_size)
        return
    expected = {
        frozenset({TRAIN}): (micro * gas * world_size, micro * gas, 1),
        frozenset({MICRO}): (micro * world_size, micro, 1),
    }.get(frozenset(given), (micro * gas * world_size, micro, gas))
    assert triad(cfg, world_size) == expected


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_three_must_agree(world_size: int) -> None:
    cfg = {TRAIN: 32, MICRO: 4, GAS: 2}
    if 4 * 2 * world_size == 32:
        assert triad(cfg, world_size) == (32, 4, 2)
        return
    with pytest.raises(ConfigError) as info:
        triad(cfg, world_size)
    assert f"{TRAIN} 32 != micro 4 * gas 2 * world_size {world_size}" in str(info.value)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_inferred_values_must_divide_exactly(world_size: int) -> None:
    # 2 * 3 * ws + 1 samples cannot be split into micro batches of 2 on ws ranks.
    train = 2 * 3 * world_size + 1
    with pytest.raises(ConfigError) as info:
        triad({TRAIN: train, MICRO: 2}, world_size)
    message = str(info.value)
    assert f"{TRAIN} {train} != micro 2 * gas 3 * world_size {world_size}" in message
    assert f"{GAS} was inferred as 3" in message
    with pytest.raises(ConfigError, match=re.escape(f"{TRAIN} {train} != micro")):
        triad({TRAIN: train, GAS: 3}, world_size)


@pytest.mark.parametrize(
    ("cfg", "world_size", "key"),
    [
        ({TRAIN: 1}, 2, MICRO),  # DeepSpeed: micro = 1 // 2 = 0
        ({TRAIN: 3}, 4, MICRO),
        ({TRAIN: 4, GAS: 4}, 2, MICRO),
        ({TRAIN: 4, MICRO: 4}, 2, GAS),
        ({TRAIN: 2, MICRO: 4}, 1, GAS),
    ],
)
def test_non_positive_inferred_value_names_the_key(cfg: dict[str, int], world_size: int, key: str) -> None:
    with pytest.raises(ConfigError, match=f"{key}: resolves to 0"):
        triad(cfg, world_size)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("value", [0, -4])
def test_given_values_must_be_positive(key: str, value: int, world_size: int) -> None:
    cfg: dict[str, object] = {TRAIN: 8 * world_size, MICRO: 8, GAS: 1}
    cfg[key] = value
    with pytest.raises(ConfigError, match=f"{key}: {value} is not allowed; expected an integer >= 1"):
        triad(cfg, world_size)


@pytest.mark.parametrize(
    ("value", "error"), [("8", ConfigTypeError), (True, ConfigTypeError), (2.5, ConfigError)]
)
def test_given_values_must_be_integers(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=f"{MICRO}: .* is not allowed; expected an integer"):
        triad({MICRO: value}, 2)


def test_whole_float_batch_values() -> None:
    assert triad({TRAIN: 16.0, MICRO: 4.0}, 2) == (16, 4, 2)


def test_auto_counts_as_not_given() -> None:
    assert triad({TRAIN: "auto", MICRO: 4, GAS: 2}, 2) == (16, 4, 2)
    assert triad({TRAIN: 16, MICRO: "auto", GAS: 2}, 2) == (16, 4, 2)
    assert triad({TRAIN: 16, MICRO: 4, GAS: "auto"}, 2) == (16, 4, 2)
    assert triad({TRAIN: "auto", MICRO: 4, GAS: "auto"}, 2) == (8, 4, 1)


def test_all_auto_cannot_be_resolved() -> None:
    with pytest.raises(ConfigError) as info:
        triad({TRAIN: "auto", MICRO: "auto", GAS: "auto"}, 2)
    message = str(info.value)
    assert f'{TRAIN}, {MICRO}, {GAS}: "auto" cannot be resolved' in message
    assert f"set {MICRO}" in message


def test_only_accumulation_is_not_enough() -> None:
    with pytest.raises(ConfigError, match=f"{GAS} alone is not enough"):
        triad({GAS: 4}, 2)
    with pytest.raises(ConfigError, match=f'{MICRO}: "auto" cannot be resolved'):
        triad({MICRO: "auto", GAS: 4}, 2)
