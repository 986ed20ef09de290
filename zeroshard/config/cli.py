"""Where the config comes from: command-line flags and the several ways `initialize()` can be given one."""

from __future__ import annotations

import argparse
import os
from typing import Any

__all__ = ["ConfigSource", "add_config_arguments", "resolve_config_source"]

ConfigSource = dict[str, Any] | str | os.PathLike[str]
"""A ds_config as a dict, or the path of its JSON file."""


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
    different = [name for name, value in given[1:] if not _same(first, value)]
    if different:
        names = ", ".join([first_name, *different])
        raise ValueError(f"config given more than once ({names}); keep exactly one of them")
    return first
