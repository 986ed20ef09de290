"""`load_config`: from a ds_config (a dict, a JSON or Hjson file, or DeepSpeed's base64 form) to a resolved,
validated `ZeroshardConfig`, and where `initialize()` finds the config (its arguments and the command-line
flags).

The steps: read the source with limits (`read.py`: UTF-8, finite numbers, nesting depth, no duplicate
keys; JSON, or Hjson as DeepSpeed reads files); rewrite deprecated keys, apply the unknown-key policy and
rename aliases (`keys.py`); check the feature blocks (`features.py`); with `elasticity.enabled`, take the
batch triad from DeepSpeed's elastic search (`elasticity.py`); resolve "auto" and complete the batch triad
(`resolve.py`); validate types and ranges (pydantic, messages
from `keys.py`); check rules across settings and build the optimizer and scheduler over a stand-in
(`checks.py`); warn about features zeroshard does not implement. All problems are collected and raised
together; all warnings are emitted at the end and kept on the config.
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from pydantic import ValidationError

from zeroshard.config.checks import check_config
from zeroshard.config.deprecated import apply_deprecations, user_spelling
from zeroshard.config.elasticity import ElasticityConfigError, ElasticityError, elastic_batch
from zeroshard.config.errors import ConfigError, ConfigWarning, Problems, show
from zeroshard.config.features import check_feature_blocks
from zeroshard.config.keys import (
    Paths,
    canonicalize,
    drop_auto,
    split_top_level,
    translate,
)
from zeroshard.config.read import MAX_DEPTH, ConfigSource, read_source
from zeroshard.config.resolve import (
    GAS,
    MICRO,
    TRAIN,
    TRIAD,
    AutoContext,
    BatchSizes,
    resolve_auto,
    resolve_batch,
)
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.config.scope_warnings import out_of_scope_warnings

__all__ = [
    "MAX_DEPTH",
    "ConfigSource",
    "add_config_arguments",
    "load_config",
    "read_source",
    "resolve_config_source",
]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds zeroshard's flags to `parser`, like `deepspeed.add_config_arguments`.

    Adds an argument group "zeroshard" with `--deepspeed` and `--zeroshard` (flags for the user's own
    script; zeroshard does not read them) and `--deepspeed_config` / `--zeroshard_config` (one option
    under two names, stored as `args.deepspeed_config`).

    Args:
        parser: The parser to extend.

    Returns:
        The same parser, for chaining.
    """
    group = parser.add_argument_group("zeroshard", "zeroshard (DeepSpeed-compatible) configuration")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="enable zeroshard (a flag for your script)"
    )
    group.add_argument(
        "--zeroshard", default=False, action="store_true", help="enable zeroshard (a flag for your script)"
    )
    group.add_argument(
        "--deepspeed_config",
        "--zeroshard_config",
        dest="deepspeed_config",
        default=None,
        type=str,
        help="path of the DeepSpeed ds_config JSON file",
    )
    return parser


def _same(a: object, b: object) -> bool:
    if a is b:
        return True
    # Two spellings of one path are the same source; two dicts are only the same object.
    if isinstance(a, str | os.PathLike) and isinstance(b, str | os.PathLike):
        return os.path.abspath(os.fspath(a)) == os.path.abspath(os.fspath(b))
    return False


def resolve_config_source(config: Any, config_params: Any, args: Any) -> ConfigSource:
    """Picks the one config among the ways `initialize()` accepts it.

    DeepSpeed's `initialize` takes `config=`, the older `config_params=`, and `args.deepspeed_config`
    (zeroshard also reads `args.zeroshard_config` and DeepSpeed's deprecated `args.deepscale_config`).
    Unlike DeepSpeed, which quietly prefers `config` over `config_params`, giving two different sources
    is an error: it is unclear which one the user meant.

    Args:
        config: `initialize(config=...)`, or None.
        config_params: `initialize(config_params=...)`, or None.
        args: The argparse namespace given to `initialize(args=...)`, or None.

    Returns:
        The single source given (a dict or a path); `load_config` reads it.

    Raises:
        ValueError: When none is given, or when two different ones are.
    """
    given: list[tuple[str, Any]] = []
    for name, value in (("config", config), ("config_params", config_params)):
        if value is not None:
            given.append((name, value))
    for attr in ("deepspeed_config", "zeroshard_config", "deepscale_config"):
        value = getattr(args, attr, None) if args is not None else None
        if value is not None:
            given.append((f"args.{attr}", value))
    if not given:
        raise ValueError(
            "no config given: pass config=<dict or path to ds_config.json> to initialize(), "
            "or --deepspeed_config <path> on the command line (see add_config_arguments)"
        )
    first_name, first = given[0]
    chosen: dict[str, Any] | str | os.PathLike[str] = first
    different = [name for name, value in given[1:] if not _same(first, value)]
    if different:
        names = ", ".join([first_name, *different])
        raise ValueError(f"config given more than once ({names}); keep exactly one of them")
    return chosen


def _check_arguments(world_size: Any, hidden_size: Any, model_dtype: Any, client_optimizer: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: {world_size!r} is not allowed; expected an integer >= 1")
    if hidden_size is not None and (
        isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1
    ):
        raise ValueError(f"hidden_size: {hidden_size!r} is not allowed; expected an integer >= 1 or None")
    if model_dtype is not None and not isinstance(model_dtype, torch.dtype):
        raise TypeError(f"model_dtype: {model_dtype!r} is not allowed; expected a torch.dtype or None")
    if client_optimizer is not None and not isinstance(getattr(client_optimizer, "defaults", None), dict):
        raise TypeError(
            f"client_optimizer: {type(client_optimizer).__name__} has no `defaults` dict; expected a "
            f"torch.optim.Optimizer or None"
        )


def _validate(
    data: dict[str, Any], batch: BatchSizes | None, world_size: int, paths: Paths, problems: Problems
) -> ZeroshardConfig | None:
    # With a broken triad, validate the rest anyway (placeholder sizes) so every problem is reported.
    sizes = batch or BatchSizes(train=world_size, micro=1, gas=1)
    full = {**data, TRAIN: sizes.train, MICRO: sizes.micro, GAS: sizes.gas, "world_size": world_size}
    try:
        return ZeroshardConfig.model_validate(full)
    except ValidationError as err:
        translate(err, paths, problems)
        return None


def _elastic_triad(
    given: Any, checked: dict[str, Any], world_size: int, problems: Problems, notes: list[str]
) -> type[ElasticityError] | None:
    """With `elasticity.enabled`, sets the batch triad in `checked` from the block as DeepSpeed 0.19.6's
    config does ([Note: elasticity]); returns the error class to raise when that failed."""
    block = checked["elasticity"]
    try:
        batch = elastic_batch(given, world_size)
    except ElasticityError as err:
        problems.add(str(err))
        return type(err)
    present = [key for key in TRIAD if key in checked]
    if present and not block["ignore_non_elastic_batch_info"]:
        problems.add(
            f"{', '.join(present)}: not allowed beside an enabled elasticity block, which sets the batch "
            f"sizes itself; delete them, or set elasticity.ignore_non_elastic_batch_info: true to have them "
            f"ignored"
        )
        return ElasticityConfigError
    elastic = {
        TRAIN: batch.train_batch_size,
        MICRO: batch.micro_batch_size,
        GAS: batch.gradient_accumulation_steps,
    }
    if elastic[GAS] < 1:
        problems.add(
            f"elasticity: at world_size {world_size} the elastic {TRAIN} {elastic[TRAIN]} is less than one "
            f"micro batch ({elastic[MICRO]}) per rank; raise max_train_batch_size or run on fewer ranks"
        )
        return ElasticityConfigError
    for key in present:
        notes.append(
            f"{key}: {show(checked[key])} is replaced by {elastic[key]} from the elasticity block at "
            f"world_size {world_size} (elasticity.ignore_non_elastic_batch_info is true)"
        )
    checked.update(elastic)
    return None


def _feature_blocks(
    data: dict[str, Any], world_size: int, problems: Problems, notes: list[str]
) -> tuple[dict[str, Any], type[ElasticityError] | None]:
    """The feature blocks checked (`check_feature_blocks`), then an enabled elasticity block applied."""
    given = data.get("elasticity")
    checked = check_feature_blocks(data, problems)
    block = checked.get("elasticity")
    if not (isinstance(block, Mapping) and block.get("enabled")):
        return checked, None
    failed: type[ElasticityError] | None = ElasticityConfigError
    if not any(line.startswith("elasticity") for line in problems.lines):  # else reported already
        failed = _elastic_triad(given, checked, world_size, problems, notes)
    if failed is not None:  # placeholder sizes, so the triad adds no problem of its own
        checked.update({TRAIN: world_size, MICRO: 1, GAS: 1})
    return checked, failed


def _raise_problems(problems: Problems, origin: str, elastic_error: type[ElasticityError] | None) -> None:
    """`problems.raise_if_any`, as DeepSpeed's elasticity class when an elasticity rule failed."""
    try:
        problems.raise_if_any(origin)
    except ConfigError as err:
        if elastic_error is None:
            raise
        raise elastic_error(str(err)) from None


def load_config(
    source: ConfigSource,
    *,
    world_size: int,
    hidden_size: int | None = None,
    model_dtype: torch.dtype | None = None,
    client_optimizer: torch.optim.Optimizer | None = None,
    optimizer_given: bool | None = None,
) -> ZeroshardConfig:
    """Reads, resolves and validates a DeepSpeed ds_config.

    Args:
        source: The config as a dict, or the path of its JSON file.
        world_size: Data-parallel world size (resolves the batch triad).
        hidden_size: The model's hidden size, when known (resolves "auto" bucket sizes).
        model_dtype: Dtype of the model's parameters, when known (resolves `enabled: "auto"` of fp16/bf16).
        client_optimizer: The optimizer given to `initialize()`, if any (resolves "auto" optimizer params).
        optimizer_given: Whether `initialize()` was given an optimizer, as an object or as a callable
            (default: whether `client_optimizer` is given). Without one, a `scheduler` block or NVMe
            optimizer offload needs an `optimizer` block.

    Returns:
        The frozen, resolved config; `config.warnings` repeats the warnings emitted.

    Raises:
        ConfigError: A `ValueError` listing every problem, one per line, each naming its dotted key,
            the value and what is allowed (`ConfigTypeError`, also a `TypeError`, when one is a type).
        ValueError: When the file is missing or not valid JSON, or an argument is out of range.
        TypeError: When the source or an argument has the wrong type.

    Warns:
        ConfigWarning: Once per deprecated key rewritten, ignored top-level key, setting without
            effect, and out-of-scope feature turned on.
    """
    _check_arguments(world_size, hidden_size, model_dtype, client_optimizer)
    raw, origin = read_source(source)
    problems = Problems()
    notes: list[str] = []
    renamed: dict[str, str] = {}
    data = apply_deprecations(raw, notes, problems, renamed)
    data = split_top_level(data, ZeroshardConfig, notes, problems)
    paths: Paths = {}
    data = canonicalize(data, ZeroshardConfig, problems, paths)
    user_spelling(paths, renamed)
    data, elastic_error = _feature_blocks(data, world_size, problems, notes)
    ctx = AutoContext(world_size, hidden_size, model_dtype, client_optimizer)
    data, given, auto = resolve_auto(data, ctx, problems)
    data = drop_auto(data, ZeroshardConfig)
    batch = resolve_batch(given, world_size, problems, auto=auto)
    cfg = _validate(data, batch, world_size, paths, problems)
    if cfg is not None:
        has_optimizer = client_optimizer is not None if optimizer_given is None else optimizer_given
        check_config(cfg, problems, notes, optimizer_given=has_optimizer)
    _raise_problems(problems, origin, elastic_error)
    if cfg is None:  # unreachable: _validate records a problem whenever it returns None
        raise RuntimeError("config validation failed without reporting a problem")
    notes.extend(out_of_scope_warnings(cfg))
    for message in notes:
        warnings.warn(message, ConfigWarning, stacklevel=2)
    return cfg.model_copy(update={"warnings": tuple(notes)})
