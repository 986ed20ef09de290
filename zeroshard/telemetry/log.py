"""The `steps_per_print` log line: its text, and where it goes when the script has not configured logging.

[Note: telemetry log lines by default]
DeepSpeed prints its `steps_per_print` lines without the script configuring anything; a Python library's
INFO records are normally dropped until the application configures `logging`. So when rank 0 asks for the
lines (`steps_per_print`), `enable_log_lines` sets the telemetry logger (not the whole `zeroshard` logger:
the resolved config that `initialize()` logs at INFO stays quiet) to INFO, unless a level was set on it
already, and attaches `DefaultHandler`. That handler decides at every record: when any handler further up
(the root logger's, after `logging.basicConfig`, or pytest's) would receive the record, it does nothing, so
a configured application gets each line once, through its own format and destination; otherwise it writes
the line to stderr. Silence the lines by leaving `steps_per_print` out, or with
`logging.getLogger("zeroshard.telemetry.telemetry").setLevel("WARNING")` (the logger that writes them).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from zeroshard.telemetry.record import StepRecord

__all__ = ["DefaultHandler", "enable_log_lines", "format_bytes", "format_memory", "format_step"]

_UNITS = ("B", "KiB", "MiB", "GiB")
_MAX_RANKS_LISTED = 8
"""Beyond this many ranks the line shows the largest and smallest memory instead of every rank's."""


def format_bytes(nbytes: float) -> str:
    """Binary units, three significant figures: "512 B", "3.25 MiB", "12.3 GiB"."""
    value, unit = _scaled(nbytes, nbytes)
    return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"


def _scaled(nbytes: float, reference: float) -> tuple[float, str]:
    """`nbytes` in the binary unit that suits `reference`."""
    value, ref = float(nbytes), abs(float(reference))
    for unit in _UNITS:
        if ref < 1024 or unit == _UNITS[-1]:
            return value, unit
        value, ref = value / 1024, ref / 1024
    raise AssertionError("unreachable")  # the loop returns at the last unit


def format_memory(per_rank: Sequence[int]) -> str:
    """ "memory 22.5 MiB" for one rank; "memory MiB r0 22.5 r1 22.5" for a few; max and min for many."""
    if len(per_rank) == 1:
        return f"memory {format_bytes(per_rank[0])}"
    _, unit = _scaled(max(per_rank), max(per_rank))

    def number(nbytes: int) -> str:
        return f"{_scaled(nbytes, max(per_rank))[0]:.3g}"

    if len(per_rank) <= _MAX_RANKS_LISTED:
        return f"memory {unit} " + " ".join(f"r{rank} {number(b)}" for rank, b in enumerate(per_rank))
    hi = max(range(len(per_rank)), key=per_rank.__getitem__)
    lo = min(range(len(per_rank)), key=per_rank.__getitem__)
    return f"memory {unit} max {number(per_rank[hi])} (r{hi}) min {number(per_rank[lo])} (r{lo})"


def format_step(record: StepRecord) -> str:
    """The `steps_per_print` log line of one step (see docs/cli.md, "Training telemetry")."""
    parts = [f"step {record.global_step}", f"samples {record.global_samples}"]
    if record.loss is not None:
        parts.append(f"loss {record.loss:.4f}")
    if record.lr:
        parts.append("lr " + ",".join(f"{lr:.3e}" for lr in record.lr))
    if record.loss_scale is not None:
        parts.append(f"loss scale {record.loss_scale:g}")
    if record.grad_norm is not None:
        parts.append(f"grad norm {record.grad_norm:.4g}")
    memory = record.rank_memory_bytes or [record.memory_bytes]
    parts += [
        f"skipped {record.skipped_steps}",
        f"{record.samples_per_s:.1f} samples/s",
        format_memory(memory),
        f"comm {format_bytes(record.comm_bytes)}, wait {record.comm_wait_s * 1e3:.1f} ms",
    ]
    return " | ".join(parts)


class DefaultHandler(logging.Handler):
    """Writes a record to stderr only when no other handler would receive it (see the module's Note).

    While a tqdm bar is on the terminal (tqdm already imported by someone), lines go through `tqdm.write`,
    which clears the bars, prints and redraws them, so log lines and bars do not overwrite each other.
    """

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("[%(asctime)s zeroshard] %(message)s", "%Y-%m-%d %H:%M:%S"))

    def handle(self, record: logging.LogRecord) -> bool:
        if _other_handlers(logging.getLogger(record.name), self):
            return False
        return bool(super().handle(record))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            tqdm = sys.modules.get("tqdm")
            if tqdm is not None:
                tqdm.tqdm.write(line, file=sys.stderr)
            else:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
        except Exception:  # logging's contract: a failing handler reports and carries on
            self.handleError(record)


_DEFAULT_HANDLER = DefaultHandler()


def _other_handlers(logger: logging.Logger, mine: logging.Handler) -> bool:
    """Whether a record of `logger` reaches any handler but `mine` (the walk `Logger.callHandlers` does)."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(h is not mine for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


def enable_log_lines(logger: logging.Logger) -> None:
    """Make `logger`'s INFO lines visible without any logging configuration (see the module's Note).

    Idempotent; leaves a level the application set on `logger` alone.
    """
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if _DEFAULT_HANDLER not in logger.handlers:
        logger.addHandler(_DEFAULT_HANDLER)
