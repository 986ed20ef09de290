"""Marks a user puts on modules for stage 3, read when the units are built: leaf module classes and
parameters declared as used outside their own module.

A mark is kept on the module it marks (one ``ZeroMarks`` record per module, as DeepSpeed keeps its
``_z3_leaf`` and ``_external_params`` on the module), so it lives and dies with the model, follows it
through ``copy.deepcopy``, and no module-level table ties models together; ``build_units`` reads them at
``initialize``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn

_ATTRIBUTE = "_zeroshard_marks"


@dataclasses.dataclass
class ZeroMarks:
    """What the user declared about one module.

    Attributes:
        leaf_classes: on a model, the module classes gathered as a whole at stage 3.
        leaf: this module itself is gathered as a whole at stage 3 (DeepSpeed's per-module ``_z3_leaf``).
        external: parameters owned elsewhere that this module's forward uses.
    """

    leaf_classes: tuple[type, ...] = ()
    leaf: bool = False
    external: list[nn.Parameter] = dataclasses.field(default_factory=list)


def _existing(module: nn.Module) -> ZeroMarks | None:
    marks = module.__dict__.get(_ATTRIBUTE)
    return marks if isinstance(marks, ZeroMarks) else None


def _marks(module: nn.Module) -> ZeroMarks:
    marks = _existing(module)
    if marks is None:
        marks = ZeroMarks()
        # object.__setattr__: a plain attribute, never a submodule, parameter or buffer of the module.
        object.__setattr__(module, _ATTRIBUTE, marks)
    return marks


def set_z3_leaf_modules(model: nn.Module, classes: Sequence[type[nn.Module]]) -> None:
    """Gather modules of these classes (e.g. a mixture-of-experts block) as a whole at stage 3.

    A leaf module's whole subtree is one unit, gathered before the leaf's forward, so data-dependent routing
    inside it never needs a collective. Call before ``zeroshard.initialize``.
    """
    _marks(model).leaf_classes = tuple(classes)


def set_leaf(module: nn.Module, flag: bool) -> None:
    """Mark (or unmark) this one module as a stage-3 leaf: its subtree is one unit."""
    _marks(module).leaf = flag


def is_leaf(module: nn.Module) -> bool:
    """Whether this module was marked a leaf with :func:`set_leaf`."""
    marks = _existing(module)
    return marks is not None and marks.leaf


def leaf_classes(model: nn.Module) -> tuple[type, ...]:
    marks = _existing(model)
    return marks.leaf_classes if marks is not None else ()


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter`` although another module owns it.

    Optional: at stage 3 a parameter read outside its own module is found on its first use and from then on
    gathered with the module that reads it ([Note: external parameters]). Declared before
    ``zeroshard.initialize``, it is gathered with ``module`` from the first step. No effect at stages 0-2.
    """
    marks = _marks(module)
    if all(p is not parameter for p in marks.external):
        marks.external.append(parameter)


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    marks = _existing(module)
    return list(marks.external) if marks is not None else []
