"""The checkpoint format: file names, tensor keys, the JSON codec for non-tensor state, metadata I/O.

[Note: checkpoint format]
A checkpoint is a directory ``<save_dir>/<tag>/`` holding

* ``shard-RRRRR-of-WWWWW.safetensors``, one per rank that owns master elements: for every piece of a
  parameter in the rank's shard, the master values under ``"<name>|<start>:<end>"`` (elements
  ``[start, end)`` of the flattened parameter) and each optimizer state tensor of that piece under
  ``"<name>|<start>:<end>|<state>"`` (``exp_avg``, ``momentum_buffer``, ``step``, ...). Units that every
  rank holds whole (stage 0) are written by the first rank only.
* ``extra.safetensors``: the module's tensors that are not trained (frozen parameters, buffers), RNG
  states, and any tensor found in client state, scheduler state or optimizer hyperparameters.
* ``metadata.json``: everything else, and the index of the tensors above: parameter names, shapes, dtypes
  and aliases (tied weights); per file its byte size, sha256 and the ``(name, start, end)`` ranges it holds
  with their optimizer-state keys and param group; the world size, stage and unit layout it was saved
  with; the config; counters; the data loader's position (epoch, samples consumed, sampler seed and
  shuffle; see zeroshard/runtime/data.py); scheduler, loss scaler, RNG and client state as JSON. Since format
  version 2 it also holds ``metadata_sha256``, the sha256 of its own content without that key (compact
  JSON, sorted keys): an edited counter, dtype or learning rate is refused, not loaded. Version 1
  checkpoints (no such key) are still read, without that check.

Nothing is pickled. Because tensors are keyed by parameter name and element range, loading at another
world size or stage is arithmetic: each rank reads, from the files whose ranges overlap its new pieces,
exactly the overlapping elements.

``<save_dir>/latest`` holds the tag of the newest complete checkpoint (DeepSpeed's convention).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.schema import check_metadata
from zeroshard.checkpoint.tensorfile import fsync_dir

logger = logging.getLogger(__name__)

FORMAT = "zeroshard-checkpoint"
VERSION = 2
READABLE_VERSIONS = (1, 2)
METADATA_SHA_KEY = "metadata_sha256"
METADATA_FILE = "metadata.json"
LATEST_FILE = "latest"
EXTRA_FILE = "extra.safetensors"
SEP = "|"
_TMP_MARK = ".tmp-"
_OLD_MARK = ".old-"


def shard_file_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def range_key(name: str, start: int, end: int, state: str | None = None) -> str:
    """``"lin1.weight|0:105"``, or ``"lin1.weight|0:105|exp_avg"`` for optimizer state."""
    key = f"{name}{SEP}{start}:{end}"
    return key if state is None else f"{key}{SEP}{state}"


def check_key_part(value: str, what: str) -> None:
    if SEP in value:
        raise CheckpointError(f"{what} {value!r} contains {SEP!r}, which checkpoint keys use as a separator")


_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-+=]*")


def check_tag(tag: str) -> None:
    """A tag becomes a directory name: letters, digits and ``_ . - + =``, not starting with a dot."""
    if not _TAG_RE.fullmatch(tag) or tag == LATEST_FILE:
        raise ValueError(
            f"checkpoint tag {tag!r} is not usable as a directory name: use letters, digits and _ . - + = "
            f"(not starting with '.', and not {LATEST_FILE!r})"
        )


def temp_dir_name(tag: str, token: str) -> str:
    return f".{tag}{_TMP_MARK}{token}"


def old_dir_name(tag: str, token: str) -> str:
    return f".{tag}{_OLD_MARK}{token}"


# -- JSON codec ------------------------------------------------------------------------------------------
# Non-tensor state (scheduler state, optimizer hyperparameters, client_state, RNG states) is stored as JSON.
# Tensors found inside go to extra.safetensors and are replaced by {"__tensor__": key}; tuples and dicts
# whose keys are not plain strings are tagged so that they decode to what was encoded.


def encode(obj: Any, where: str, sink: dict[str, torch.Tensor]) -> Any:
    """``obj`` as JSON-compatible data, moving tensors into ``sink`` under keys derived from ``where``.

    Raises:
        CheckpointError: an object that JSON cannot represent without pickle, named by its path.
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        sink[where] = obj.detach()
        return {"__tensor__": where}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, f"{where}[{i}]", sink) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, f"{where}[{i}]", sink) for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v, f"{where}.{k}", sink) for k, v in obj.items()}
        return {
            "__items__": [
                [encode(k, f"{where}<key{i}>", sink), encode(v, f"{where}[{k!r}]", sink)]
                for i, (k, v) in enumerate(obj.items())
            ]
        }
    item = getattr(obj, "item", None)  # numpy scalars
    if callable(item) and type(obj).__module__ == "numpy":
        return encode(item(), where, sink)
    raise CheckpointError(
        f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be stored in a checkpoint "
        "(checkpoints hold tensors and JSON values only, never pickles): convert it to numbers, strings, "
        "lists, dicts or tensors"
    )


def decode(obj: Any, load: Callable[[str], torch.Tensor]) -> Any:
    """The inverse of :func:`encode`; ``load(key)`` returns a tensor stored by it."""
    if isinstance(obj, list):
        return [decode(v, load) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if set(obj) == {"__tensor__"}:
        return load(obj["__tensor__"])
    if set(obj) == {"__dtype__"}:
        dtype = getattr(torch, obj["__dtype__"], None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"unknown dtype {obj['__dtype__']!r} in checkpoint metadata")
        return dtype
    if set(obj) == {"__tuple__"}:
        return tuple(decode(v, load) for v in obj["__tuple__"])
    if set(obj) == {"__items__"}:
        return {_hashable(decode(k, load)): decode(v, load) for k, v in obj["__items__"]}
    return {k: decode(v, load) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


# -- metadata and `latest` -------------------------------------------------------------------------------


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` and fsync it (callers rename it into place)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def metadata_digest(meta: Mapping[str, Any]) -> str:
    """sha256 of ``meta`` without its own checksum, as compact JSON with sorted keys."""
    body = {k: v for k, v in meta.items() if k != METADATA_SHA_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_metadata(path: str, meta: Mapping[str, Any]) -> None:
    """Write ``meta`` with its checksum (computed over what a reader will parse back) to ``path``."""
    parsed = json.loads(json.dumps(meta))  # tuples become lists, keys strings: as read back
    parsed[METADATA_SHA_KEY] = metadata_digest(parsed)
    write_json(path, parsed)


def write_latest(save_dir: str, tag: str, token: str) -> None:
    """Point ``latest`` at ``tag`` atomically: readers see the old tag or the new, never a partial file."""
    tmp = os.path.join(save_dir, f".{LATEST_FILE}{_TMP_MARK}{token}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, LATEST_FILE))
    fsync_dir(save_dir)


_MAX_LATEST_BYTES = 4096
_MAX_METADATA_BYTES = 1 << 30


def confined(root: str, name: object, what: str) -> str:
    """``root/name`` when ``name`` is one path component whose file stays inside ``root``.

    Tags, the content of ``latest`` and the file names in metadata.json are untrusted input: a name with
    ``/``, ``..``, an absolute path, or a symlink resolving outside ``root`` is refused before anything
    outside ``root`` is opened (only symlinks are read to resolve it, never the target).

    Raises:
        CheckpointError: naming ``what`` (the file or argument that held the name) and the name.
    """
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or os.path.isabs(name)
        or any(c in name for c in ("/", "\\", "\0"))
    ):
        raise CheckpointError(
            f"{what} names {name!r}: a checkpoint names its directories and files by one path component "
            f"inside {root} (no '/', no '..', no absolute path)"
        )
    path = os.path.join(root, name)
    real = os.path.realpath(path)
    if os.path.dirname(real) != os.path.realpath(root):
        raise CheckpointError(f"{what} names {name!r}, a symlink leading out of {root} (to {real})")
    return path


def read_latest(load_dir: str) -> str | None:
    """The tag ``<load_dir>/latest`` names, checked to be one path component inside ``load_dir``.

    Raises:
        CheckpointError: naming ``latest``: empty, too large, not UTF-8, or a name leaving ``load_dir``.
    """
    path = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    confined(load_dir, LATEST_FILE, load_dir)
    with open(path, "rb") as f:
        raw = f.read(_MAX_LATEST_BYTES + 1)
    if len(raw) > _MAX_LATEST_BYTES:
        raise CheckpointError(f"{path} is over {_MAX_LATEST_BYTES} bytes: it should hold one tag")
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path} is not UTF-8 text ({err}): it should hold one tag") from err
    if not tag:
        raise CheckpointError(f"{path} is empty: it should name the tag of the newest checkpoint")
    confined(load_dir, tag, path)
    return tag


def resolve(load_dir: str, tag: str | None) -> str | None:
    """The checkpoint directory for ``tag`` (default: the one ``latest`` names); None without ``latest``.

    ``load_dir`` may also be a checkpoint directory itself (it holds metadata.json, or DeepSpeed's model
    states). A tag whose directory is missing while a save was replacing it (it then sits under
    ``.<tag>.old-*``) resolves to that copy.

    Raises:
        CheckpointError: the tag's directory does not exist, or the tag (or ``latest``) names a path
            outside ``load_dir``.
    """
    if tag is None and (
        os.path.isfile(os.path.join(load_dir, METADATA_FILE))
        or any(n.endswith("_model_states.pt") for n in _listdir(load_dir))  # one DeepSpeed checkpoint
    ):
        return load_dir
    source = "tag="
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            return None
        source = os.path.join(load_dir, LATEST_FILE)
    path = confined(load_dir, tag, source)
    if os.path.isdir(path):
        return path
    prefix = f".{tag}{_OLD_MARK}"
    olds = sorted(n for n in _listdir(load_dir) if n.startswith(prefix))
    if olds:
        logger.warning(
            "checkpoint %s is missing; a save replacing it was interrupted, using %s", path, olds[-1]
        )
        return confined(load_dir, olds[-1], load_dir)
    raise CheckpointError(f"checkpoint directory {path} (named by {source}) does not exist")


def tag_exists(load_dir: str, tag: str) -> bool:
    """Whether ``tag``'s directory (or the copy an interrupted save left aside) exists in ``load_dir``."""
    path = confined(load_dir, tag, "tag=")
    prefix = f".{tag}{_OLD_MARK}"
    return os.path.isdir(path) or any(n.startswith(prefix) for n in _listdir(load_dir))


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def stale_temp_dirs(save_dir: str) -> list[str]:
    """Directories that interrupted saves left behind (never a published checkpoint)."""
    return [
        os.path.join(save_dir, n)
        for n in _listdir(save_dir)
        if n.startswith(".") and (_TMP_MARK in n or _OLD_MARK in n)
    ]


def read_metadata(path: str) -> dict[str, Any]:
    """Read and check ``<path>/metadata.json``.

    Raises:
        CheckpointError: no metadata (with a hint when it is a DeepSpeed checkpoint), bad JSON, or a
            format or version this zeroshard cannot read.
    """
    file = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(file):
        hint = ""
        if any(n.endswith("model_states.pt") for n in _listdir(path)):
            hint = (
                " (it looks like a DeepSpeed checkpoint: open it with load_checkpoint or open_checkpoint, "
                "which read DeepSpeed's layout)"
            )
        raise CheckpointError(f"{path} is not a zeroshard checkpoint: it has no {METADATA_FILE}{hint}")
    confined(path, METADATA_FILE, path)
    if os.path.getsize(file) > _MAX_METADATA_BYTES:
        raise CheckpointError(f"{file} is over {_MAX_METADATA_BYTES} bytes: the checkpoint is corrupt")
    try:
        with open(file, encoding="utf-8") as f:
            meta = json.load(f)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        msg = "nested too deeply" if isinstance(err, RecursionError) else f"not valid JSON ({err})"
        raise CheckpointError(f"{file} is {msg}: the checkpoint is corrupt") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{file} does not describe a {FORMAT}")
    version = meta.get("version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise CheckpointError(
            f"{file} has format version {version!r}; this zeroshard reads versions {READABLE_VERSIONS}"
        )
    if version >= 2:
        recorded = meta.pop(METADATA_SHA_KEY, None)
        if recorded != metadata_digest(meta):
            raise CheckpointError(
                f"{file} does not match its recorded {METADATA_SHA_KEY} ({recorded!r}): metadata.json was "
                "edited or damaged after it was written"
            )
    check_metadata(meta, file)
    return meta
