"""Makes ``import deepspeed`` give ``zeroshard.deepspeed`` (stdlib only: a ``.pth`` file imports it).

[Note: deepspeed alias]
``install()`` puts :class:`AliasFinder` first on ``sys.meta_path``. It answers for ``deepspeed`` and every
``deepspeed.X`` with the module ``zeroshard.deepspeed.X`` itself (one module object under two names, so
``deepspeed.comm is zeroshard.deepspeed.comm``), and ``importlib.metadata`` finds a small ``deepspeed``
distribution whose version is ``zeroshard.deepspeed.__version__``, which is what transformers' and
accelerate's availability checks (``importlib.util.find_spec``, ``importlib.metadata.version``) ask.

It acts only when asked: ``zeroshard_as_deepspeed.pth`` (installed next to the package) calls
``install_if_requested()``, which does nothing unless ``ZEROSHARD_AS_DEEPSPEED=1``; ``zeroshard launch`` sets
that variable. When a real DeepSpeed is installed too, it is shadowed and one warning says so, the first
time ``deepspeed`` is imported. Nothing here imports zeroshard (or torch) before ``import deepspeed``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ENV_VAR = "ZEROSHARD_AS_DEEPSPEED"
ALIAS = "deepspeed"
TARGET = "zeroshard.deepspeed"

logger = logging.getLogger("zeroshard.deepspeed")


def _target_name(fullname: str) -> str | None:
    if fullname == ALIAS or fullname.startswith(ALIAS + "."):
        return TARGET + fullname[len(ALIAS) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads ``deepspeed.X`` as the already imported module ``zeroshard.deepspeed.X``."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system has just set module.__spec__ to the alias's spec: give the module its own back.
        module.__spec__ = self._own_spec
        _alias_imported()


def _alias_imported() -> None:
    """Register ``deepspeed.X`` in ``sys.modules`` for every ``zeroshard.deepspeed.X`` imported so far.

    A later ``import deepspeed.X`` then finds the module there, as it would in DeepSpeed, where importing
    the package imported it. Loading it afresh under the alias would set it as an attribute of its package,
    over the function or class the package imported under the same name (``deepspeed.utils.z3_leaf_module``
    is a function, ``deepspeed.utils.tensor_fragment`` a class)."""
    for name, module in list(sys.modules.items()):
        if name.startswith(TARGET + "."):
            sys.modules.setdefault(ALIAS + name[len(TARGET) :], module)


class _AliasDistribution(importlib.metadata.Distribution):
    """The ``deepspeed`` distribution that ``importlib.metadata`` reports while the alias is installed."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            version = importlib.import_module(TARGET).__version__
            return f"Metadata-Version: 2.1\nName: {ALIAS}\nVersion: {version}\n"
        if filename == "top_level.txt":
            return ALIAS + "\n"
        return None

    def locate_file(self, path: Any) -> Path:
        return Path(importlib.util.find_spec("zeroshard").origin or ".").parent / "deepspeed" / str(path)  # type: ignore[union-attr]


class AliasFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder for ``deepspeed`` and ``deepspeed.*`` (see [Note: deepspeed alias])."""

    def __init__(self) -> None:
        self._warned = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        real = _target_name(fullname)
        if real is None:
            return None
        if fullname == ALIAS:
            self._warn_if_shadowing()
        found = importlib.util.find_spec(real)
        if found is None:
            return None
        return importlib.util.spec_from_loader(
            fullname, _AliasLoader(real), is_package=found.submodule_search_locations is not None
        )

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context | None = None
    ) -> Iterable[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is not None and name.replace("_", "-").lower() == ALIAS:
            return [_AliasDistribution()]
        return []

    def _warn_if_shadowing(self) -> None:
        if self._warned:
            return
        self._warned = True
        real = importlib.machinery.PathFinder.find_spec(ALIAS)
        if real is not None:
            logger.warning(
                "%s=1: `import deepspeed` gives zeroshard.deepspeed; "
                "the DeepSpeed installed at %s is not used",
                ENV_VAR,
                real.origin or list(real.submodule_search_locations or []),
            )


def installed() -> bool:
    return any(isinstance(f, AliasFinder) for f in sys.meta_path)


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (idempotent)."""
    if not installed():
        sys.meta_path.insert(0, AliasFinder())


def install_if_requested() -> None:
    """``install()`` when ``ZEROSHARD_AS_DEEPSPEED`` is ``1`` (what the ``.pth`` file runs at start-up)."""
    if os.environ.get(ENV_VAR, "") == "1":
        install()
