"""``deepspeed.utils.logging``: ``logger``, the rank-filtered ``log_dist`` family and the level helpers.

``logger`` is the standard ``logging`` logger ``zeroshard.deepspeed``: it has no handler of its own, so what
it shows, and where, is the application's logging configuration (zeroshard's library never prints). Like
DeepSpeed's logger it carries ``logger.warning_once`` and ``logger.log_dist_once``.

[Note: which ranks log]
:func:`get_dist_msg` decides for the whole family, as DeepSpeed's does: without a process group every call
logs, prefixed ``[Rank -1]``; with one, a call logs only on the ranks it lists (``[-1]`` first: every
rank), so ``ranks=None`` logs nothing once a process group exists.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.comm import get_rank, is_initialized

__all__ = [
    "get_current_level",
    "get_dist_msg",
    "get_log_level_from_string",
    "log_dist",
    "log_dist_once",
    "log_levels",
    "logger",
    "print_configuration",
    "print_json_dist",
    "print_rank_0",
    "set_log_level_from_string",
    "should_log_le",
    "warning_once",
]

logger = logging.getLogger("zeroshard.deepspeed")
"""DeepSpeed's ``deepspeed.utils.logger``: the ``zeroshard.deepspeed`` logger."""

log_levels = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
"""The level names DeepSpeed's string helpers accept, lower case, and their ``logging`` levels."""


@functools.cache
def warning_once(*args: Any, **kwargs: Any) -> None:
    """``logger.warning(*args, **kwargs)``, once per process for each distinct set of (hashable) arguments."""
    logger.warning(*args, **kwargs)


def print_configuration(args: Any, name: str) -> None:
    """Log ``name`` and then each attribute of ``args`` (an ``argparse.Namespace``), sorted, dot-aligned."""
    logger.info("%s:", name)
    for key in sorted(vars(args)):
        logger.info("  %s %s %s", key, "." * (29 - len(key)), getattr(args, key))


def _this_rank_logs(ranks: Sequence[int] | None) -> bool:
    """[Note: which ranks log]."""
    if not is_initialized():
        return True
    wanted = list(ranks or [])
    return bool(wanted) and (wanted[0] == -1 or get_rank() in set(wanted))


def get_dist_msg(message: str, ranks: Sequence[int] | None = None) -> str | None:
    """``"[Rank r] message"`` when this rank logs (see [Note: which ranks log]; ``r`` is -1 without a
    process group), else ``None``."""
    if not _this_rank_logs(ranks):
        return None
    return f"[Rank {get_rank() if is_initialized() else -1}] {message}"


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` at ``level`` where :func:`get_dist_msg` says so."""
    final = get_dist_msg(message, None if ranks is None else list(ranks))
    if final is not None:
        logger.log(level, "%s", final)


@functools.cache
def _log_dist_once(message: str, ranks: tuple[int, ...] | None, level: int) -> None:
    log_dist(message, ranks=ranks, level=level)


def log_dist_once(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """:func:`log_dist`, once per process for each distinct ``(message, ranks, level)``."""
    _log_dist_once(message, None if ranks is None else tuple(ranks), level)


def print_json_dist(
    message: dict[str, Any], ranks: Sequence[int] | None = None, path: str | None = None
) -> None:
    """Where this rank logs ([Note: which ranks log]), set ``message["rank"]`` (-1 without a process group)
    and write ``message`` as JSON to ``path``, synced to disk."""
    if not _this_rank_logs(ranks):
        return
    if path is None:
        raise TypeError("print_json_dist: path is None; pass the file to write the JSON to")
    message["rank"] = get_rank() if is_initialized() else -1
    with open(path, "w") as out:
        json.dump(message, out)
        out.flush()
        os.fsync(out.fileno())


def get_log_level_from_string(log_level_str: str) -> int:
    """The ``logging`` level named ``log_level_str`` (any case: ``"info"`` -> ``logging.INFO``).

    Raises:
        ValueError: the name is not one of :data:`log_levels`.
    """
    level = log_levels.get(log_level_str.lower())
    if level is None:
        raise ValueError(
            f"{log_level_str.lower()} is not one of the valid logging levels. "
            f"Valid log levels are {log_levels.keys()}."
        )
    return level


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set the level named ``log_level_str`` on ``custom_logger`` (default :data:`logger`) and on its
    handlers."""
    level = get_log_level_from_string(log_level_str)
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_current_level() -> int:
    """:data:`logger`'s effective level."""
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    """Whether :data:`logger`'s effective level is at most the level named ``max_log_level_str``
    (``should_log_le("info")``: the logger shows INFO).

    Raises:
        ValueError: ``max_log_level_str`` is not a string, or names no level.
    """
    if not isinstance(max_log_level_str, str):
        raise ValueError(f"{max_log_level_str} is not a string")
    return get_current_level() <= get_log_level_from_string(max_log_level_str)


def print_rank_0(message: str, debug: bool = False, force: bool = False) -> None:
    """Log ``message`` on rank 0 (DeepSpeed prints it; zeroshard's library never prints)."""
    if get_rank() == 0:
        logger.info("%s", message)


# DeepSpeed's logger carries these two; scripts call them as logger methods.
logger.warning_once = warning_once  # type: ignore[attr-defined]
logger.log_dist_once = log_dist_once  # type: ignore[attr-defined]

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
