"""``deepspeed.utils.numa``: DeepSpeed's core-list syntax (``--bind_core_list``). Binding processes to cores
(``get_numactl_cmd``, ``get_numa_cores``) is refused at use: zeroshard's launcher runs ``torchrun``."""

from __future__ import annotations

from zeroshard.deepspeed import surface

__all__ = ["parse_range", "parse_range_list"]


def parse_range(rng: str) -> range:
    """``"5"`` or ``"2-4"`` (both ends included) as a range.

    Raises:
        ValueError: not a number or two numbers joined by one dash, or an end below its start.
    """
    try:
        value = int(rng)
    except ValueError:
        pass
    else:
        return range(value, value + 1)
    parts = str(rng).split("-")
    try:
        start, end = (int(p) for p in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        start = end = None
    if start is None or end is None:
        raise ValueError(f"bad range {rng!r}: expected a number or two numbers joined by a dash ('2-4')")
    if start > end:
        raise ValueError(f"bad range {rng!r}: the end is below the start")
    return range(start, end + 1)


def parse_range_list(range_str: str) -> list[int]:
    """A comma-separated list of core numbers and ranges (``"0,2-4,6"``) as the numbers it names, in order.

    Raises:
        ValueError: an item :func:`parse_range` refuses, a negative number, or items that overlap or do not
            ascend.
    """
    numbers: list[int] = []
    for item in str(range_str).split(","):
        part = parse_range(item)
        if part[0] <= (numbers[-1] if numbers else -1):
            raise ValueError(
                f"bad range list {range_str!r}: items must be core numbers >= 0, ascending without overlaps"
            )
        numbers.extend(part)
    return numbers


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
