"""Run DeepSpeed 0.19.6's own ``compute_elastic_config`` over a table of inputs and write the results to
tests/data/elasticity_reference.json, which tests/test_elasticity.py compares zeroshard's implementation
with (``make elasticity-reference``).

DeepSpeed 0.19.8, the version installed beside zeroshard, removed elasticity, so the reference is read from
the 0.19.6 release itself: ``pip download deepspeed==0.19.6 --no-deps --no-binary :all:`` fetches its sdist
(or ``--sdist PATH`` names one already downloaded), and the three modules of ``deepspeed/elasticity/`` that
the function needs (``elasticity.py``, ``config.py``, ``constants.py``) are extracted, unchanged, into a
temporary package. They import little else from DeepSpeed, so a small shim stands in for it:

- ``deepspeed/__init__.py`` and ``deepspeed/elasticity/__init__.py`` are empty (the real ones import torch,
  the accelerator and the torch-elastic agent, which the function does not use);
- ``deepspeed/git_version_info.py`` defines ``version = "0.19.6"`` (used only in an error message);
- ``deepspeed/utils/__init__.py`` defines ``logger``, a plain ``logging`` logger.

numpy and packaging, which the modules import, come from this environment. Each table row is one call:
the ds_config, the target DeepSpeed version, the world size, ``return_microbatch``, and the ``WORLD_SIZE``
environment variable the call sees (absent unless the row sets it). The output keeps, per row, the
returned tuple (numbers as plain JSON) or the name of the exception class raised, and names the sdist and
the sha256 of it and of the ``elasticity.py`` the results came from.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import itertools
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "tests" / "data" / "elasticity_reference.json"
VERSION = "0.19.6"
MODULES = ("elasticity.py", "config.py", "constants.py")
SHIM = {
    "deepspeed/__init__.py": "",
    "deepspeed/elasticity/__init__.py": "",
    "deepspeed/git_version_info.py": f'version = "{VERSION}"\n',
    "deepspeed/utils/__init__.py": 'import logging\n\nlogger = logging.getLogger("deepspeed")\n',
}


def _download(into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", f"deepspeed=={VERSION}", "--no-deps"]
    subprocess.run(
        [*command, "--no-binary", ":all:", "--quiet", "--disable-pip-version-check", "-d", str(into)],
        check=True,
    )
    found = sorted(into.glob(f"deepspeed-{VERSION}.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download left no deepspeed-{VERSION}.tar.gz in {into}")
    return found[0]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _install(sdist: Path, into: Path) -> dict[str, str]:
    """Extracts the elasticity modules of `sdist` under `into` beside the shim; returns their sha256."""
    digests: dict[str, str] = {}
    with tarfile.open(sdist) as tar:
        for name in MODULES:
            member = tar.extractfile(f"deepspeed-{VERSION}/deepspeed/elasticity/{name}")
            if member is None:
                raise RuntimeError(f"{sdist} has no deepspeed/elasticity/{name}")
            data = member.read()
            digests[f"deepspeed/elasticity/{name}"] = _sha256(data)
            target = into / "deepspeed" / "elasticity" / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    for path, text in SHIM.items():
        (into / path).parent.mkdir(parents=True, exist_ok=True)
        (into / path).write_text(text)
    return digests


def _block(**settings: Any) -> dict[str, Any]:
    return {"elasticity": {"enabled": True, **settings}}


def _row(ds_config: Any, world_size: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "ds_config": ds_config,
        "target": extra.pop("target", VERSION),
        "world_size": world_size,
        "return_microbatch": extra.pop("return_microbatch", False),
        "env": extra.pop("env", {}),
    }


def _edge_rows() -> list[dict[str, Any]]:
    """Hand-picked cases: every error condition, and the corners of the search."""
    v1, v2 = {"version": 0.1}, {"version": 0.2}
    base = {"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]}
    empty_range = {"max_train_batch_size": 10, "micro_batch_sizes": [2], "min_gpus": 100, "max_gpus": 200}
    return [
        _row([1, 2]),
        _row({"train_batch_size": 8}),
        _row({"elasticity": {"enabled": False, **base}}),
        _row({"elasticity": base}),
        _row(_block(micro_batch_sizes=[2, 4])),
        _row(_block(max_train_batch_size=100)),
        _row(_block(max_train_batch_size=100, micro_batch_sizes=4)),
        _row(_block(max_train_batch_size=100, micro_batch_sizes=[2, 4.0])),
        _row(_block(max_train_batch_size=100, micro_batch_sizes=[2, 0])),
        _row(_block(max_train_batch_size=100, micro_batch_sizes=[-2])),
        _row(_block(**base, min_gpus=0)),
        _row(_block(**base, max_gpus=0)),
        _row(_block(**base, min_gpus=8, max_gpus=4)),
        _row(_block(**base, model_parallel_size=0)),
        _row(_block(**base, num_gpus_per_node=0)),
        _row(_block(**base, min_time=-1)),
        _row(_block(**base, min_time=30, **v1)),
        _row(_block(**base, model_parallel_size=2, **v1)),
        _row(_block(**base, version=0.3)),
        _row(_block(**base, version=1)),
        _row(_block(**base, version=0.15)),
        _row(_block(**base, version=0.05)),
        _row(_block(**base, version="0.1")),
        _row(_block(**base, **v1), target="0.3.7"),
        _row(_block(**base, **v1), target="0.3.8"),
        _row(_block(**base, **v1), target="0.4"),
        _row(_block(max_train_batch_size=4, micro_batch_sizes=[2, 8], **v1)),
        _row(_block(max_train_batch_size=4, micro_batch_sizes=[2, 8], **v2), 1),
        _row(_block(max_train_batch_size=12, micro_batch_sizes=[12], **v1)),
        _row(_block(max_train_batch_size=12, micro_batch_sizes=[4, 6], **v1)),
        _row(_block(max_train_batch_size=10**7, micro_batch_sizes=[1], **v1)),
        _row(_block(max_train_batch_size=10**7, micro_batch_sizes=[3, 5], max_gpus=64, **v1), 16),
        _row(_block(**base, **v1), 7),
        _row(_block(**base, **v1), 0, return_microbatch=True),
        _row(_block(**base, **v1), 0, return_microbatch=True, env={"WORLD_SIZE": "8"}),
        _row(_block(**base, **v1), 0, return_microbatch=True, env={"WORLD_SIZE": "7"}),
        _row(_block(**base, **v1), 0, return_microbatch=True, env={"WORLD_SIZE": "many"}),
        _row(_block(**base, **v2)),
        _row(_block(**base, **v2), 0, env={"WORLD_SIZE": "4"}),
        _row(_block(**base, **v2), 0, env={"WORLD_SIZE": "4x"}),
        _row(_block(**base, **v2), 0, return_microbatch=True, env={"WORLD_SIZE": "3"}),
        _row(_block(**base, num_gpus_per_node=4, model_parallel_size=3, **v2), 4),
        _row(_block(**base, num_gpus_per_node=4, model_parallel_size=2, **v2), 8),
        _row(_block(**base, num_gpus_per_node=4, model_parallel_size=2, **v2), 4),
        _row(_block(**base, num_gpus_per_node=8, model_parallel_size=4, min_gpus=8, max_gpus=64, **v2), 16),
        _row(_block(max_train_batch_size=6, micro_batch_sizes=[4], **v2), 2),
        _row(_block(max_train_batch_size=100, micro_batch_sizes=[3, 7], prefer_larger_batch=False, **v2), 5),
        _row(_block(**empty_range, prefer_larger_batch=False, **v1)),
        _row(_block(**empty_range, prefer_larger_batch=False, **v1), 4),
        _row(_block(**empty_range, prefer_larger_batch=True, **v1)),
        _row(_block(**empty_range, prefer_larger_batch=True, **v1), 4),
        _row(_block(**empty_range, prefer_larger_batch=False, **v2), 4),
        _row(_block(**empty_range, prefer_larger_batch=True, **v2), 4),
    ]


def _grid_rows(count: int, seed: int) -> list[dict[str, Any]]:
    """A fixed sample of the product of settings, world sizes and versions."""
    grid = itertools.product(
        (0.1, 0.2),
        ([1], [2, 4, 6], [3, 5], [8], [2, 3, 7], [4, 2], [16, 12]),
        (1, 7, 64, 100, 513, 2000, 30000),
        ((1, 10000), (2, 8), (4, 4), (3, 100), (16, 512)),
        (True, False),
        ((1, 1), (2, 1), (4, 2), (8, 1), (8, 4), (6, 3)),
        (0, 1, 2, 3, 4, 6, 8, 16, 24),
    )
    cases = list(grid)
    random.Random(seed).shuffle(cases)
    rows = []
    for version, micro, cap, (low, high), prefer, (per_node, mp), world_size in cases[:count]:
        settings: dict[str, Any] = {
            "max_train_batch_size": cap,
            "micro_batch_sizes": micro,
            "min_gpus": low,
            "max_gpus": high,
            "prefer_larger_batch": prefer,
            "version": version,
        }
        if version == 0.2:
            settings |= {"num_gpus_per_node": per_node, "model_parallel_size": mp}
        env = {"WORLD_SIZE": str(per_node * 2)} if world_size == 0 and low % 2 == 1 else {}
        rows.append(
            _row(_block(**settings), world_size, env=env, return_microbatch=(world_size + cap) % 2 == 1)
        )
    return rows


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return value


def _run(rows: list[dict[str, Any]], package_dir: Path) -> None:
    sys.path.insert(0, str(package_dir))
    module = importlib.import_module("deepspeed.elasticity.elasticity")
    if not str(Path(module.__file__ or "")).startswith(str(package_dir)):
        raise RuntimeError(f"imported {module.__file__}, not the extracted 0.19.6 module")
    saved = os.environ.get("WORLD_SIZE")
    try:
        for row in rows:
            os.environ.pop("WORLD_SIZE", None)
            os.environ.update(row["env"])
            try:
                got = module.compute_elastic_config(
                    row["ds_config"], row["target"], world_size=row["world_size"],
                    return_microbatch=row["return_microbatch"],
                )  # fmt: skip
                row["result"] = _plain(got)
            except Exception as err:  # the class name is the expected outcome
                row["error"] = type(err).__name__
    finally:
        os.environ.pop("WORLD_SIZE", None)
        if saved is not None:
            os.environ["WORLD_SIZE"] = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, help=f"deepspeed-{VERSION}.tar.gz (default: pip download it)")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or _download(Path(tmp) / "download")
        digests = _install(sdist, Path(tmp) / "pkg")
        rows = _edge_rows() + _grid_rows(count=500, seed=0)
        _run(rows, Path(tmp) / "pkg")
        out = {
            "deepspeed_version": VERSION,
            "source": f"{sdist.name}, DeepSpeed's release on PyPI (pip download deepspeed=={VERSION})",
            "sdist_sha256": _sha256(sdist.read_bytes()),
            "module_sha256": digests,
            "generated_by": "tools/elasticity_reference.py",
            "rows": rows,
        }
    lines = ",\n".join("    " + json.dumps(row, sort_keys=True) for row in rows)
    head = json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=2, sort_keys=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(head[:-2] + ',\n  "rows": [\n' + lines + "\n  ]\n}\n")
    failures = sum("error" in row for row in rows)
    print(f"{args.output}: {len(rows)} rows ({failures} raise) from DeepSpeed {VERSION}")


if __name__ == "__main__":
    main()
