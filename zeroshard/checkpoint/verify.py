"""Check a whole checkpoint offline, every byte, without loading it: ``zeroshard checkpoint verify``."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from zeroshard.checkpoint.convert import open_checkpoint
from zeroshard.checkpoint.deepspeed.reader import DeepSpeedReader
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import range_key
from zeroshard.checkpoint.reader import VALUE, VECTOR


@dataclass(frozen=True)
class VerifyReport:
    """What a verified checkpoint holds."""

    path: str
    files: int
    bytes: int
    parameters: int
    tensors: int


def verify_checkpoint(ckpt_dir: str | os.PathLike[str], tag: str | None = None) -> VerifyReport:
    """Check every file of a checkpoint: names, metadata checksum and fields, sizes, sha256, tensor index.

    Reads every byte once (the sha256 of each file) and every safetensors header; loads no tensor data.

    Raises:
        CheckpointError: naming the first file and field found wrong.
    """
    with open_checkpoint(ckpt_dir, tag) as reader:
        if isinstance(reader, DeepSpeedReader):  # no checksums to check: every rank file opens, is allowed
            reader.verify_files(reader.optim_files)
            paths = [os.path.join(reader.path, f) for f in os.listdir(reader.path)]
            return VerifyReport(
                path=reader.path,
                files=len(paths),
                bytes=sum(os.path.getsize(p) for p in paths if os.path.isfile(p)),
                parameters=len(reader.params),
                tensors=sum(len(r) for r in reader.ranges.values()),
            )
        files = reader.meta["files"]
        reader.verify_files(list(files))
        tensors = 0
        for name, ranges in reader.ranges.items():
            for r in ranges:
                f = reader.tensor_file(r.file)
                for state, kind in [(None, VECTOR), *r.states.items()]:
                    if kind == VALUE:
                        continue
                    key = range_key(name, r.start, r.end, state)
                    if key not in f:
                        raise CheckpointError(f"{reader.path}: {r.file} has no tensor {key!r}")
                    if kind == VECTOR and math.prod(f.shape(key)) != r.end - r.start:
                        raise CheckpointError(
                            f"{reader.path}: {r.file} holds {key!r} with shape {f.shape(key)}, not the "
                            f"{r.end - r.start} elements metadata.json records"
                        )
                    tensors += 1
        return VerifyReport(
            path=reader.path,
            files=len(files),
            bytes=sum(int(rec["bytes"]) for rec in files.values()),
            parameters=len(reader.params),
            tensors=tensors,
        )
