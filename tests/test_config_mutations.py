"""`zeroshard check-config` and `initialize()` give the same verdict on broken configs (issue #22 item 4).

A seeded generator mutates the repository's own configs (examples/configs/*.json, tests/configs/*.json):
wrong types, strings in numeric slots, NaN/Infinity and out-of-float-range numbers, huge and negative
numbers, dropped keys, unknown keys, bytes that are not UTF-8, deep nesting, and wrong optimizer and
scheduler params. For each mutated file the verdict of `check` (the function behind the CLI) must equal
the verdict of `initialize()` on a tiny model at world size 1; `initialize()` may only succeed or raise a
`ConfigError`, and a rejection must name the key the mutation touched.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.cli.check_config import check
from zeroshard.config import ConfigError

ROOT = Path(__file__).parent.parent
BASES = sorted((ROOT / "examples" / "configs").glob("*.json")) + sorted(
    (ROOT / "tests" / "configs").glob("*.json")
)
SEED = 22
CASES = 240

Path_ = tuple[str | int, ...]
_RAW = "__raw_token__"  # replaced by a JSON token json.dumps cannot write (1e400)


@dataclass
class Mutation:
    """One mutated config: its bytes, the key it touched (named in any rejection) and what was done."""

    data: bytes
    key: str
    what: str


def _nodes(tree: Any, path: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    """Every (path, value) below the root, skipping comment keys ("_comment", "_expect")."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if not key.startswith("_"):
                yield (*path, key), value
                yield from _nodes(value, (*path, key))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield (*path, index), value
            yield from _nodes(value, (*path, index))


def _key_of(path: Path_) -> str:
    """The last key name on `path` (a list index names the list's key)."""
    return next(str(part) for part in reversed(path) if isinstance(part, str))


def _set(tree: Any, path: Path_, value: Any) -> None:
    for part in path[:-1]:
        tree = tree[part]
    tree[path[-1]] = value


def _drop(tree: Any, path: Path_) -> None:
    for part in path[:-1]:
        tree = tree[part]
    del tree[path[-1]]


def _dump(tree: Any, raw: str = "1e400") -> bytes:
    text = json.dumps(tree, allow_nan=True, ensure_ascii=False)
    return text.replace(f'"{_RAW}"', raw).encode("utf-8", "surrogateescape")


class Mutator:
    """Seeded mutations of one base config; each method returns a `Mutation`."""

    def __init__(self, rng: random.Random, base: dict[str, Any]) -> None:
        self.rng = rng
        self.base = base

    def _pick(self, want: Callable[[Path_, Any], bool] = lambda p, v: True) -> tuple[dict[str, Any], Path_]:
        tree = copy.deepcopy(self.base)
        # nvme_path names a directory that must exist where training runs, which a config check cannot
        # know; initialize() refuses a missing one (a ValueError naming the key) when it opens the store.
        nodes = [path for path, value in _nodes(tree) if want(path, value) and "nvme_path" not in path]
        return tree, self.rng.choice(nodes or [path for path, _ in _nodes(tree)])

    def wrong_type(self) -> Mutation:
        tree, path = self._pick()
        value = self.rng.choice(["x", "1", "1e-3", [1], {"a": 1}, True, None, [[]], 0.5])
        _set(tree, path, value)
        return Mutation(_dump(tree), _key_of(path), f"{path} = {value!r}")

    def _number_path(self) -> tuple[dict[str, Any], Path_]:
        return self._pick(lambda p, v: isinstance(v, int | float) and not isinstance(v, bool))

    def non_finite(self) -> Mutation:
        tree, path = self._number_path()
        token = self.rng.choice(["NaN", "Infinity", "-Infinity", "1e400", "-1e400"])
        _set(tree, path, _RAW)
        return Mutation(_dump(tree, token), _key_of(path), f"{path} = {token}")

    def huge(self) -> Mutation:
        tree, path = self._number_path()
        value = self.rng.choice([1e30, 2**63, 2**70, 10**40, 1e300, 2**62, 2**31])
        _set(tree, path, value)
        return Mutation(_dump(tree), _key_of(path), f"{path} = {value!r}")

    def negative(self) -> Mutation:
        tree, path = self._number_path()
        value = self.rng.choice([-1, -0.5, -(2**63), -1e9, 0])
        _set(tree, path, value)
        return Mutation(_dump(tree), _key_of(path), f"{path} = {value!r}")

    def drop(self) -> Mutation:
        tree, path = self._pick(lambda p, v: isinstance(p[-1], str))
        _drop(tree, path)
        return Mutation(_dump(tree), _key_of(path), f"del {path}")

    def unknown_key(self) -> Mutation:
        tree = copy.deepcopy(self.base)
        path: Path_ = self.rng.choice([(), *(p for p, v in _nodes(tree) if isinstance(v, dict))])
        name = self.rng.choice(["zz_not_a_key", "stagee", "lrr", "warmup_steps", "device_"])
        target = tree
        for part in path:
            target = target[part]
        target[name] = 1
        # An unknown top-level key is ignored with a warning, as DeepSpeed ignores it; any rejection of
        # this config must name it.
        return Mutation(_dump(tree), name, f"{path}.{name} = 1")

    def not_utf8(self) -> Mutation:
        tree, path = self._pick(lambda p, v: isinstance(v, str) or isinstance(p[-1], str))
        leaf = path[-1]
        if isinstance(leaf, str) and (not isinstance(_get(tree, path), str) or self.rng.random() < 0.5):
            # Bad bytes in the key itself: a lone surrogate becomes the raw byte when encoded.
            parent = _get(tree, path[:-1])
            parent[leaf + "\udcff"] = parent.pop(leaf)
            return Mutation(_dump(tree), leaf, f"{path} key + b'\\xff'")
        _set(tree, path, _get(tree, path) + "\udcfe")
        return Mutation(_dump(tree), _key_of(path), f"{path} value + b'\\xfe'")

    def deep(self) -> Mutation:
        tree, path = self._pick()
        depth = self.rng.choice([3, 20, 40, 300])
        value: Any = 1
        for _ in range(depth):
            value = [value] if self.rng.random() < 0.5 else {"a": value}
        _set(tree, path, value)
        return Mutation(_dump(tree), _key_of(path), f"{path} nested {depth} deep")

    def params(self) -> Mutation:
        blocks = [name for name in ("optimizer", "scheduler") if isinstance(self.base.get(name), dict)]
        if not blocks:
            return self.wrong_type()
        block = self.rng.choice(blocks)
        tree = copy.deepcopy(self.base)
        params = tree[block].setdefault("params", {})
        choice = self.rng.randrange(6)
        if choice == 0 and params:  # a wrong kind of value for an existing param
            key = self.rng.choice(sorted(params))
            params[key] = self.rng.choice(["0.1", None, True, [0.1, "x"], {"a": 1}, [], 2**70])
        elif choice == 1:  # an unknown param
            key = self.rng.choice(["lrr", "momentum_", "warmup_steps", "foo"])
            params[key] = 0.1
        elif choice == 2:  # out of range
            key = self.rng.choice(["lr", "eps", "weight_decay", "warmup_num_steps", "total_num_steps"])
            params[key] = self.rng.choice([-1, -1e-3, 0, 10**30])
        elif choice == 3:  # a per-group list (the tiny model has one group), well or badly typed
            key = self.rng.choice(["warmup_max_lr", "warmup_min_lr", "lr_range_test_min_lr", "betas"])
            params[key] = self.rng.choice([[1e-3], ["x"], [None], [[1e-3]], [True], [], [_RAW]])
        elif choice == 4:  # another type name: a rejection names the type (or its class)
            new_type = self.rng.choice(
                [
                    "SGD",
                    "adamw",
                    "Lamb",
                    "LBFGS",
                    "Lion",
                    "Adagrad",
                    "OneCycle",
                    "WarmupCosineLR",
                    "CosineAnnealingLR",
                    "ReduceLROnPlateau",
                    "StepLR",
                    "nope",
                    3,
                ]
            )
            tree[block]["type"] = new_type
            key = new_type if isinstance(new_type, str) else "type"
        else:  # a required param dropped, or the whole params block replaced
            key = "params"
            tree[block]["params"] = self.rng.choice([{}, [], "x", None])
        return Mutation(_dump(tree), key, f"{block}: {key} -> {json.dumps(tree[block], default=str)[:120]}")

    KINDS = (
        "wrong_type",
        "non_finite",
        "huge",
        "negative",
        "drop",
        "unknown_key",
        "not_utf8",
        "deep",
        "params",
    )


def _get(tree: Any, path: Path_) -> Any:
    for part in path:
        tree = tree[part]
    return tree


def _base_config(path: Path, nvme: Path) -> dict[str, Any]:
    """The config at `path`, with NVMe paths moved under the test's temporary directory and without the
    monitors that reach a service (wandb, comet)."""
    nvme.mkdir(exist_ok=True)
    tree = json.loads(path.read_text())
    tree.pop("wandb", None)
    tree.pop("comet", None)
    for node_path, value in list(_nodes(tree)):
        if node_path[-1] == "nvme_path" and isinstance(value, str):
            _set(tree, node_path, str(nvme))
    return tree


def _initialize_verdict(config: Path) -> str | None:
    """None when `initialize()` accepts `config`, else its `ConfigError` message (others propagate)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    try:
        engine, *_ = zeroshard.initialize(
            model=model, model_parameters=model.parameters(), config=str(config), dist_init_required=False
        )
    except ConfigError as err:
        return str(err)
    engine.destroy()
    return None


def _check_verdict(config: Path) -> str | None:
    status, _, messages = check(str(config), world_size=1, model_dtype="fp32")
    return messages[0] if status else None


def test_base_configs_are_many_and_mostly_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert len(BASES) >= 20
    accepted = 0
    for base in BASES:
        path = tmp_path / base.name
        path.write_text(json.dumps(_base_config(base, tmp_path / "nvme")))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            verdict = _check_verdict(path)
            assert verdict == _initialize_verdict(path), base.name
        accepted += verdict is None
    assert accepted >= len(BASES) - 2  # hf_trainer_auto_z3 needs a client optimizer for its "auto" params


@pytest.fixture
def quiet_logger() -> Iterator[None]:
    """zeroshard's warnings silenced for one test, its level restored after (later tests read them)."""
    logger = logging.getLogger("zeroshard")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def test_check_config_and_initialize_agree_on_mutated_configs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quiet_logger: None
) -> None:
    monkeypatch.chdir(tmp_path)  # monitors' output paths are relative
    monkeypatch.setenv("WANDB_MODE", "disabled")
    rng = random.Random(SEED)
    bases = []
    for base in BASES:
        tree = _base_config(base, tmp_path / "nvme")
        probe = tmp_path / f"base-{base.name}"
        probe.write_text(json.dumps(tree))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if _check_verdict(probe) is None:
                bases.append((base.name, tree))
    disagree, crashed, unnamed, rejected = [], [], [], 0
    for index in range(CASES):
        name, tree = bases[index % len(bases)]
        kind = Mutator.KINDS[(index // len(bases) + index) % len(Mutator.KINDS)]
        mutation: Mutation = getattr(Mutator(rng, tree), kind)()
        path = tmp_path / f"case{index}.json"
        path.write_bytes(mutation.data)
        label = f"case {index} ({name}, {kind}: {mutation.what})"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            by_check = _check_verdict(path)
            try:
                by_initialize = _initialize_verdict(path)
            except Exception as err:
                crashed.append(f"{label}: initialize raised {type(err).__name__}: {err}")
                continue
        if (by_check is None) != (by_initialize is None):
            disagree.append(f"{label}: check-config {by_check!r}, initialize {by_initialize!r}")
        elif by_check is not None:
            rejected += 1
            key = mutation.key.lower()
            if key not in by_check.lower() or key not in (by_initialize or "").lower():
                unnamed.append(f"{label}: {mutation.key!r} not named in {by_check!r}")
    assert not crashed, "\n".join(crashed)
    assert not disagree, f"{len(disagree)} of {CASES} disagree:\n" + "\n".join(disagree)
    assert not unnamed, "\n".join(unnamed)
    assert rejected >= CASES // 3, (
        f"only {rejected} of {CASES} mutations were rejected: the generator is weak"
    )


def test_a_per_group_list_is_checked_against_the_model_by_initialize(tmp_path: Path) -> None:
    """The one check the config alone cannot make: a per-param-group list needs one value per group of the
    model's optimizer. check-config checks the values; initialize() checks the length, as a ConfigError."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": [1e-3, 2e-3], "warmup_num_steps": 5}},
    }
    path = tmp_path / "groups.json"
    path.write_text(json.dumps(config))
    assert _check_verdict(path) is None
    one_group = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_max_lr: expected 1 values"):
        zeroshard.initialize(model=one_group, config=str(path), dist_init_required=False)
    two_groups = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    groups = [{"params": two_groups[0].parameters()}, {"params": two_groups[1].parameters()}]
    engine, optimizer, _, _ = zeroshard.initialize(
        model=two_groups, model_parameters=groups, config=str(path), dist_init_required=False
    )
    assert [group["lr"] for group in optimizer.param_groups] == [0.0, 0.0]  # warmup starts at warmup_min_lr
    engine.destroy()
    config["scheduler"]["params"]["warmup_max_lr"] = [1e-3, "x"]
    path.write_text(json.dumps(config))
    assert "scheduler.params.warmup_max_lr[1]: expected a number" in (_check_verdict(path) or "")
    # OneCycle's bounds take one value per group too (DeepSpeed documents and applies them so).
    config["scheduler"] = {
        "type": "OneCycle",
        "params": {"cycle_min_lr": [1e-4, 2e-4], "cycle_max_lr": [1e-3, 2e-3], "cycle_min_mom": [0.8, 0.85]},
    }
    path.write_text(json.dumps(config))
    assert _check_verdict(path) is None
    groups = [{"params": list(two_groups[0].parameters())}, {"params": list(two_groups[1].parameters())}]
    engine, optimizer, _, _ = zeroshard.initialize(
        model=two_groups, model_parameters=groups, config=str(path), dist_init_required=False
    )
    assert [group["lr"] for group in optimizer.param_groups] == [1e-4, 2e-4]
    assert [group["betas"][0] for group in optimizer.param_groups] == [0.8, 0.85]
    engine.destroy()
