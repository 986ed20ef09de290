"""`zeroshard convert`: a checkpoint's weights as consolidated safetensors, offline, a parameter at a time."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "register"]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint_dir",
        metavar="CKPT_DIR",
        help="a save_checkpoint directory (its 'latest' is used unless --tag), or one checkpoint; "
        "zeroshard's or DeepSpeed's (ZeRO stages 1-3)",
    )
    parser.add_argument(
        "output_dir", metavar="OUT_DIR", help="where to write the safetensors (and config.json)"
    )
    parser.add_argument(
        "--tag", default=None, help="the checkpoint tag to convert (default: the one 'latest' names)"
    )
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="dtype of the floating tensors written (default fp32, the master weights)",
    )
    parser.add_argument(
        "--to",
        choices=("safetensors", "deepspeed", "zeroshard"),
        default="safetensors",
        help="safetensors: consolidated weights (Hugging Face layout, the default); deepspeed: a DeepSpeed "
        "ZeRO checkpoint (weights, fp32 masters, optimizer state, scheduler, counters) that DeepSpeed's "
        "load_checkpoint and zero_to_fp32.py read; zeroshard: a DeepSpeed checkpoint rewritten in "
        "zeroshard's format (checksummed, no pickles)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="with --to deepspeed: the number of ranks DeepSpeed will resume on (default: as saved)",
    )
    parser.add_argument(
        "--stage",
        type=int,
        choices=(1, 2, 3),
        default=None,
        help="with --to deepspeed: the ZeRO stage DeepSpeed will resume at (default: as saved)",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="split the weights into files of at most this size, with an index (default 5GB)",
    )


def register(subparsers: Any) -> None:
    """Adds `zeroshard convert` to `subparsers`."""
    parser = subparsers.add_parser(
        "convert",
        help="write a checkpoint's weights as consolidated safetensors (Hugging Face layout)",
        description="Convert a zeroshard or DeepSpeed checkpoint, saved at any world size and stage, into "
        "consolidated safetensors weights (model.safetensors, or numbered files plus "
        "model.safetensors.index.json), with config.json when the model was a Hugging Face model. Needs no "
        "GPU and no process group, and holds one parameter in memory at a time. With --to deepspeed, write "
        "a DeepSpeed ZeRO checkpoint instead, for any world size and stage.",
    )
    _add_arguments(parser)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import (
        CheckpointError,
        convert_checkpoint,
        convert_to_deepspeed,
        convert_to_zeroshard,
    )

    if args.to != "deepspeed" and (args.world_size is not None or args.stage is not None):
        print("zeroshard convert: error: --world-size and --stage need --to deepspeed", file=sys.stderr)
        return 2
    start = time.perf_counter()
    if args.to != "safetensors":
        try:
            if args.to == "zeroshard":
                path = convert_to_zeroshard(args.checkpoint_dir, args.output_dir, args.tag)
            else:
                path = convert_to_deepspeed(
                    args.checkpoint_dir,
                    args.output_dir,
                    args.tag,
                    world_size=args.world_size,
                    stage=args.stage,
                )
        except (CheckpointError, ValueError, OSError) as err:
            print(f"zeroshard convert: error: {err}", file=sys.stderr)
            return 1
        print(f"wrote {args.to} checkpoint {path} in {time.perf_counter() - start:.1f}s")
        return 0
    try:
        names = convert_checkpoint(
            args.checkpoint_dir,
            args.output_dir,
            tag=args.tag,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
        )
    except (CheckpointError, ValueError, OSError) as err:
        print(f"zeroshard convert: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {', '.join(names)} to {args.output_dir} in {time.perf_counter() - start:.1f}s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m zeroshard.cli.convert ...`: the subcommand on its own."""
    parser = argparse.ArgumentParser(prog="zeroshard convert")
    _add_arguments(parser)
    return _run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
