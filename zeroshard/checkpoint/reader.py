"""Read any element range of any saved parameter or optimizer state, whatever layout it was saved with.

This is where resharding happens (see format.py [Note: checkpoint format]): a request for elements
``[start, end)`` of a parameter reads, from each saved range that overlaps it, only the overlap, straight
into the caller's tensor. Files are opened lazily, verified (size and sha256) the first time they are
opened, and can be closed as soon as a caller is done with them, so a reader holds at most the tensors its
caller asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

import torch

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import (
    EXTRA_FILE,
    METADATA_FILE,
    confined,
    decode,
    range_key,
    read_metadata,
)
from zeroshard.checkpoint.tensorfile import TensorFile, dtype_from_name, verify_file

# Kinds of optimizer state, per saved range (metadata "state" maps each key to one of these).
VECTOR = "vector"  # a 1-D tensor with one element per parameter element: reshards
SCALAR = "scalar"  # a 0-dim tensor, the same for every piece of the parameter (Adam's step)
FIXED = "fixed"  # a tensor of another shape: loads only into the same range it was saved from
VALUE = "value"  # a JSON value (int, float, ...), kept in metadata.json

_CAST_CHUNK = 1 << 20  # elements read per step when the stored dtype is cast on the way in


@dataclass(frozen=True)
class SavedRange:
    """Elements ``[start, end)`` of one parameter, as one file holds them."""

    file: str
    start: int
    end: int
    group: int | None
    states: dict[str, str] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)


class _HasStates(Protocol):
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def states(self) -> dict[str, str]: ...


def agreed_states(path: str, name: str, ranges: Sequence[_HasStates], start: int, end: int) -> dict[str, str]:
    """The optimizer-state keys (and kinds) that the saved ``ranges`` overlapping ``name[start:end]`` all
    hold; ranges that disagree make the checkpoint inconsistent (a CheckpointError naming ``path``)."""
    found: dict[str, str] | None = None
    for r in ranges:
        if r.start < end and start < r.end:
            if found is None:
                found = dict(r.states)
            elif found != r.states:
                raise CheckpointError(
                    f"{path}: {name!r} has optimizer state {sorted(found)} in one saved range and "
                    f"{sorted(r.states)} in another: the checkpoint is inconsistent"
                )
    return found or {}


class CheckpointReader:
    """The tensors of one checkpoint directory, by parameter name and element range.

    Invariant (checked on open): for every trained parameter the saved ranges tile ``[0, numel)`` exactly.
    """

    def __init__(self, path: str, *, verify: bool = True) -> None:
        self.path = path
        self.meta = read_metadata(path)
        self.verify = verify
        self.params: dict[str, dict[str, Any]] = self.meta["parameters"]
        self.aliases: dict[str, str] = self.meta.get("aliases", {})
        self.module_extra: dict[str, Any] = self.meta.get("module", {})
        self.ranges: dict[str, list[SavedRange]] = {name: [] for name in self.params}
        files = self.meta.get("files")
        if not isinstance(files, dict):
            raise CheckpointError(f"{path}/{METADATA_FILE}: 'files' is {type(files).__name__}, not a mapping")
        for fname in files:  # every name checked before any shard is opened
            confined(path, fname, f"{path}/{METADATA_FILE} 'files'")
        for fname, entry in files.items():
            for r in entry.get("ranges", []):
                if r["param"] not in self.ranges:
                    raise CheckpointError(
                        f"{path}: {fname} holds {r['param']!r}, which metadata.json does not list"
                    )
                self.ranges[r["param"]].append(
                    SavedRange(
                        fname,
                        int(r["start"]),
                        int(r["end"]),
                        r.get("group"),
                        r.get("state", {}),
                        r.get("values", {}),
                    )
                )
        for name, ranges in self.ranges.items():
            ranges.sort(key=lambda r: r.start)
            self._check_coverage(name, ranges)
        self._files: dict[str, TensorFile] = {}
        self._verified: set[str] = set()

    def _check_coverage(self, name: str, ranges: list[SavedRange]) -> None:
        numel = self.numel(name)
        at, tiled = 0, True
        for r in ranges:
            tiled = tiled and r.start == at and r.end > r.start
            at = r.end
        if not tiled or at != numel:
            spans = ", ".join(f"{r.start}:{r.end} in {r.file}" for r in ranges) or "none"
            raise CheckpointError(
                f"{self.path}: the saved ranges of {name!r} ({spans}) do not cover its {numel} elements "
                "exactly: metadata.json is inconsistent"
            )

    # -- names and shapes ------------------------------------------------------------------------------
    def canonical(self, name: str) -> str | None:
        """The name under which ``name``'s values are stored (tied weights are stored once), or None."""
        if name in self.params or name in self.module_extra:
            return name
        target = self.aliases.get(name)
        return (
            target if target is not None and (target in self.params or target in self.module_extra) else None
        )

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.params:
            return tuple(self.params[name]["shape"])
        return self._file(EXTRA_FILE).shape(self._extra_key(name))

    def numel(self, name: str) -> int:
        n = 1
        for d in self.shape(name):
            n *= d
        return n

    def stored_dtype(self, name: str) -> torch.dtype:
        """fp32 master dtype for trained parameters; the module's dtype for the other entries."""
        if name in self.params:
            return dtype_from_name(self.meta["master_dtype"])
        return dtype_from_name(self.module_extra[name]["dtype"])

    def _extra_key(self, name: str) -> str:
        entry = self.module_extra.get(name)
        if not isinstance(entry, dict) or "key" not in entry:
            raise CheckpointError(f"{self.path}: {name!r} is not a tensor of the checkpoint")
        return str(entry["key"])

    # -- reading -----------------------------------------------------------------------------------------
    def _file(self, fname: str) -> TensorFile:
        f = self._files.get(fname)
        if f is None:
            full = confined(self.path, fname, f"{self.path}/{METADATA_FILE}")
            record = self.meta["files"].get(fname)
            if record is None:
                raise CheckpointError(f"{self.path}: metadata.json lists no file {fname}")
            if fname not in self._verified:
                verify_file(full, int(record["bytes"]), record["sha256"] if self.verify else None)
                self._verified.add(fname)
            f = self._files[fname] = TensorFile(full)
        return f

    def tensor_file(self, fname: str) -> TensorFile:
        """The open file ``fname`` of the checkpoint, its size and checksum verified on first use."""
        return self._file(fname)

    def files_for(self, name: str, start: int, end: int) -> list[str]:
        """The files a read of ``name[start:end]`` touches."""
        if name not in self.params:
            return [EXTRA_FILE]
        return [r.file for r in self.ranges[name] if r.start < end and start < r.end]

    def verify_files(self, files: set[str] | list[str]) -> None:
        """Check sizes and checksums now (each file once), rather than on first read."""
        for fname in sorted(set(files)):
            self._file(fname)

    def read_range(
        self, name: str, start: int, end: int, out: torch.Tensor | None = None, state: str | None = None
    ) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened parameter (or of its optimizer state ``state``).

        ``out`` (1-D, contiguous, ``end - start`` elements, any floating dtype) receives them, cast if
        needed; without it a tensor of the stored dtype is returned.
        """
        if name not in self.params:
            if state is not None:
                raise CheckpointError(f"{self.path}: {name!r} was not trained, so it has no optimizer state")
            return self._read(EXTRA_FILE, self._extra_key(name), start, end, out)
        result = out
        for r in self.ranges[name]:
            lo, hi = max(start, r.start), min(end, r.end)
            if lo >= hi:
                continue
            if state is not None and r.states.get(state) != VECTOR:
                raise CheckpointError(
                    f"{self.path}: {r.file} has no per-element {state!r} for {name}[{r.start}:{r.end}]"
                )
            key = range_key(name, r.start, r.end, state)
            if result is None:
                result = torch.empty(end - start, dtype=self._file(r.file).dtype(key))
            self._read(r.file, key, lo - r.start, hi - r.start, result[lo - start : hi - start])
        if result is None:
            result = torch.empty(0, dtype=self.stored_dtype(name))
        return result

    def _read(self, fname: str, key: str, start: int, end: int, out: torch.Tensor | None) -> torch.Tensor:
        f = self._file(fname)
        if out is None or out.dtype == f.dtype(key):
            return f.read(key, start, end, out=out)
        # A cast: through a bounded buffer, so a large parameter never has a second full-size copy.
        step = min(end - start, _CAST_CHUNK)
        buffer = torch.empty(step, dtype=f.dtype(key))
        for lo in range(start, end, step):
            hi = min(lo + step, end)
            out[lo - start : hi - start].copy_(f.read(key, lo, hi, out=buffer[: hi - lo]))
        return out

    def read_full(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor ``name`` with its shape, in ``dtype`` (default: as stored)."""
        shape = self.shape(name)
        n = self.numel(name)
        out = torch.empty(n, dtype=dtype or self.stored_dtype(name))
        return self.read_range(name, 0, n, out=out).reshape(shape)

    def range_states(self, name: str, start: int, end: int) -> dict[str, str]:
        """Optimizer-state keys (and kinds) of ``name[start:end]``; overlapping saved ranges must agree."""
        return agreed_states(self.path, name, self.ranges.get(name, []), start, end)

    def read_state(self, name: str, start: int, end: int, state: str) -> Any:
        """Optimizer state ``state`` of ``name[start:end]``: a tensor, or a JSON value."""
        kind = self.range_states(name, start, end).get(state)
        if kind == VECTOR:
            return self.read_range(name, start, end, state=state)
        first = next(r for r in self.ranges[name] if r.start < end and start < r.end)
        if kind == VALUE:
            return decode(first.values[state], self.extra_tensor)
        if kind == FIXED and (first.start, first.end) != (start, end):
            raise CheckpointError(
                f"{self.path}: optimizer state {state!r} of {name!r} is not elementwise (saved for elements "
                f"{first.start}:{first.end}), so it cannot be loaded into elements {start}:{end}; load at "
                "the world size and stage it was saved with"
            )
        f = self._file(first.file)
        return f.read_tensor(range_key(name, first.start, first.end, state))

    def extra_tensor(self, key: str) -> torch.Tensor:
        return self._file(EXTRA_FILE).read_tensor(key)

    def decode(self, obj: Any) -> Any:
        return decode(obj, self.extra_tensor)

    def release(self, files: list[str] | set[str]) -> None:
        """Close ``files`` (they reopen, without verifying again, if read later)."""
        for fname in files:
            f = self._files.pop(fname, None)
            if f is not None:
                f.close()

    def close(self) -> None:
        self.release(list(self._files))

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
