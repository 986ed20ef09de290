"""`zeroshard check-config`: validate a ds_config as `initialize()` would, before launching anything."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

import torch

from zeroshard.config import ConfigWarning, load_config

__all__ = ["check", "register"]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def check(
    path: str, *, world_size: int, hidden_size: int | None = None, model_dtype: str | None = None
) -> tuple[int, str, list[str]]:
    """Loads `path` with `load_config` and reports the outcome.

    Returns:
        `(status, output, messages)`: status 0 with the resolved config as JSON (defaults filled in) and
        the warnings, or status 1 with no output and the error message as the only message.
    """
    try:
        with warnings.catch_warnings():
            # The warnings come back on `config.warnings`; printing them again here would double them.
            warnings.simplefilter("ignore", ConfigWarning)
            config = load_config(
                path,
                world_size=world_size,
                hidden_size=hidden_size,
                model_dtype=_DTYPES[model_dtype] if model_dtype else None,
            )
    except (ValueError, TypeError) as err:  # ConfigError is a ValueError; a bad file raises either
        return 1, "", [str(err)]
    return 0, config.dump(), list(config.warnings)


def _run(args: argparse.Namespace) -> int:
    status, output, messages = check(
        args.config, world_size=args.world_size, hidden_size=args.hidden_size, model_dtype=args.model_dtype
    )
    if status != 0:
        print(f"zeroshard check-config: error: {messages[0]}", file=sys.stderr)
        return status
    if not args.quiet:
        print(output)
    for message in messages:
        print(f"warning: {message}", file=sys.stderr)
    noun = "warning" if len(messages) == 1 else "warnings"
    print(f"{args.config}: valid for world size {args.world_size} ({len(messages)} {noun})", file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    """Adds `zeroshard check-config` to `subparsers`."""
    parser = subparsers.add_parser(
        "check-config",
        help="validate a ds_config.json as initialize() would and print it resolved",
        description="Validates a DeepSpeed ds_config.json exactly as zeroshard.initialize() does "
        "(load_config), prints the resolved config with every default filled in, and every warning. "
        "Exits 1 with the error message when the config cannot be used.",
    )
    parser.add_argument("config", help="path of the ds_config JSON file")
    parser.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="data-parallel world size the batch sizes are resolved for (default 1)",
    )
    parser.add_argument(
        "--hidden-size",
        type=int,
        default=None,
        help='the model\'s hidden size, to resolve "auto" bucket sizes as initialize() would',
    )
    parser.add_argument(
        "--model-dtype",
        choices=sorted(_DTYPES),
        default=None,
        help='the model\'s parameter dtype, to resolve fp16/bf16 enabled: "auto"',
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print only the warnings and the verdict")
    parser.set_defaults(func=_run)
