"""The process `zeroshard launch` starts on each rank: `import deepspeed` made to give zeroshard.deepspeed,
`--local_rank=N` added as DeepSpeed's launcher adds it, then the user's script run as `__main__`.

Usage (torchrun runs it; not meant to be typed): ``python -m zeroshard.cli.worker [--as-module]
[--no-local-rank] SCRIPT ARGS...``. The argument order the script sees is DeepSpeed's:
``SCRIPT --local_rank=N ARGS...``. ``ZEROSHARD_AS_DEEPSPEED=1`` is set for the script and its children.
When the script returns, a process group it left up is shut down (``zeroshard.shutdown_distributed``).
"""

from __future__ import annotations

import os
import runpy
import sys

import zeroshard_as_deepspeed

__all__ = ["main", "script_argv"]


def script_argv(argv: list[str], local_rank: str) -> tuple[bool, list[str]]:
    """``(as_module, sys.argv for the script)`` from the worker's own arguments."""
    as_module = no_local_rank = False
    while argv and argv[0] in ("--as-module", "--no-local-rank"):
        as_module |= argv[0] == "--as-module"
        no_local_rank |= argv[0] == "--no-local-rank"
        argv = argv[1:]
    if not argv:
        raise SystemExit("zeroshard.cli.worker: no script given")
    script, rest = argv[0], argv[1:]
    return as_module, [script, *([] if no_local_rank else [f"--local_rank={local_rank}"]), *rest]


def main(argv: list[str] | None = None) -> None:
    as_module, sys.argv = script_argv(
        list(sys.argv[1:] if argv is None else argv), os.environ.get("LOCAL_RANK", "0")
    )
    os.environ[zeroshard_as_deepspeed.ENV_VAR] = "1"
    zeroshard_as_deepspeed.install()
    try:
        if as_module:
            runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as done:  # sys.exit(main()): a success leaves as a return does
        if done.code not in (None, 0):
            raise
        _leave()
        raise
    _leave()


def _leave() -> None:
    """Shut down the process group the script left up, if any. Collective: every rank ran the script to
    its end.

    DeepSpeed scripts (DeepSpeedExamples' DCGAN among them) end with the process group up, and a gloo
    group torn down at exit under a peer still using it can abort the process (about 1 run in 15):
    ``shutdown_distributed`` makes the ranks leave together. Imported only here: what the script imports
    first (it may set CUDA_VISIBLE_DEVICES before torch) is the script's choice.
    """
    from zeroshard.dist import shutdown_distributed

    shutdown_distributed()


if __name__ == "__main__":
    main()
