"""The `steps_per_print` log line: its text.

Telemetry writes the line as an INFO record of the `zeroshard.telemetry.telemetry` logger and nothing
more: the library attaches no handler and sets no level, so where the lines go (and whether INFO records
show at all) is the application's logging configuration, e.g. `logging.basicConfig(level=logging.INFO)`.
"""

from __future__ import annotations

from collections.abc import Sequence

from zeroshard.telemetry.record import StepRecord

__all__ = ["format_bytes", "format_memory", "format_step"]

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
    if record.cross_node_bytes:
        parts[-1] += f", {format_bytes(record.cross_node_bytes)} across nodes"
    return " | ".join(parts)
