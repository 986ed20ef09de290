"""``deepspeed.utils.logging``: ``logger`` and ``log_dist`` (standard ``logging``, rank-filtered)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.comm import get_rank

__all__ = ["log_dist", "logger", "print_rank_0"]

logger = logging.getLogger("zeroshard.deepspeed")
"""DeepSpeed's ``deepspeed.utils.logger``: the ``zeroshard.deepspeed`` logger."""


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the listed ranks (``None``, ``[-1]``: every rank), prefixed with the rank."""
    wanted = list(ranks) if ranks is not None else [-1]
    rank = get_rank()
    if -1 in wanted or rank in wanted:
        logger.log(level, "[Rank %d] %s", rank, message)


def print_rank_0(message: str, debug: bool = False, force: bool = False) -> None:
    """Log ``message`` on rank 0 (DeepSpeed prints it; zeroshard's library never prints)."""
    if get_rank() == 0:
        logger.info("%s", message)


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
