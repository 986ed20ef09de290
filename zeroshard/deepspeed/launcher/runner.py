"""``deepspeed.launcher.runner``: ``DEEPSPEED_ENVIRONMENT_NAME`` and ``main``, over ``zeroshard launch``.

accelerate imports ``DEEPSPEED_ENVIRONMENT_NAME`` whenever ``accelerate launch`` starts a DeepSpeed run
(it writes that file only for multi-node launches through DeepSpeed's own runner). ``main`` runs
``zeroshard launch`` with the given arguments: the flags DeepSpeed's ``deepspeed`` command and
``zeroshard launch`` share (``--num_gpus``, ``--hostfile``, ``--include``, ``--exclude``, ...) mean the same.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from zeroshard.deepspeed import surface

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "main"]

# The file of extra environment variables DeepSpeed's multi-node runner exports on every node.
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")


def main(args: Sequence[str] | None = None) -> int:
    """``zeroshard launch ARGS`` (default: ``sys.argv[1:]``); returns its exit status."""
    from zeroshard.cli.main import main as zeroshard_main

    return zeroshard_main(["launch", *(sys.argv[1:] if args is None else args)])


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
