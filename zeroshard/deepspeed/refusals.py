"""The objects that stand for DeepSpeed names zeroshard refuses at use ([Note: generated surface]).

Each keeps DeepSpeed's signature (``__signature__``, from the inventory), checks a call against it first (a
call DeepSpeed would reject raises DeepSpeed's ``TypeError``), then raises ``NotImplementedError`` naming
the DeepSpeed name, the feature it belongs to (:data:`FEATURES`) and the docs section. Importing or naming
one never raises: real scripts import far more than they use.
"""

from __future__ import annotations

import ast
import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

__all__ = [
    "DOCS",
    "FEATURES",
    "MARK",
    "RefusedObject",
    "feature_of",
    "refuse",
    "refused_class",
    "refused_function",
    "refusing_getattr",
    "signature_of",
]

DOCS = "docs/porting.md#refused-at-use"
MARK = "__zeroshard_surface__"
"""The attribute that says how a name is provided: ``"refused"``, ``"accepted"`` or ``"data"``."""

# The feature a refused name belongs to, by DeepSpeed module prefix (the longest prefix wins).
FEATURES: dict[str, str] = {
    "deepspeed.pipe": "pipeline parallelism",
    "deepspeed.runtime.pipe": "pipeline parallelism",
    "deepspeed.moe": "mixture of experts",
    "deepspeed.sequence": "sequence parallelism (Ulysses, FPDT)",
    "deepspeed.runtime.sequence_parallel": "sequence parallelism (Ulysses)",
    "deepspeed.runtime.tensor_parallel": "tensor parallelism (AutoTP)",
    "deepspeed.runtime.domino": "Domino tensor-parallel overlap",
    "deepspeed.runtime.hybrid_engine": "the RLHF hybrid engine (inference kernels)",
    "deepspeed.runtime.hybrid_engine_graph": "the RLHF hybrid engine (inference kernels)",
    "deepspeed.runtime.rollout": "RLHF rollout engines",
    "deepspeed.runtime.zenflow": "ZenFlow",
    "deepspeed.runtime.superoffload": "SuperOffload",
    "deepspeed.runtime.data_pipeline": "data efficiency (curriculum learning, data sampling, random-LTD)",
    "deepspeed.runtime.swap_tensor": "DeepSpeed's NVMe swapper internals (zeroshard's offload replaces them)",
    "deepspeed.runtime.zero": "DeepSpeed's ZeRO internals (zeroshard's engine replaces them)",
    "deepspeed.runtime.fp16": "DeepSpeed's fp16 optimizer internals (zeroshard's engine replaces them)",
    "deepspeed.runtime.comm": "compressed communication (1-bit optimizers)",
    "deepspeed.runtime.checkpoint_engine": "DeepSpeed's checkpoint engines (Nebula, FastPersist, decoupled)",
    "deepspeed.runtime.model_checkpointing": "DeepSpeed's checkpoint writers (FastPersist)",
    "deepspeed.runtime": "DeepSpeed's runtime internals (zeroshard's engine replaces them)",
    "deepspeed.compression": "model compression (quantization-aware training, pruning)",
    "deepspeed.autotuning": "the autotuner",
    "deepspeed.profiling": (
        "DeepSpeed's FLOPs profiler (torch.utils.flop_counter.FlopCounterMode counts a model's FLOPs)"
    ),
    "deepspeed.monitor": "the Comet monitor (TensorBoard, CSV and W&B are written)",
    "deepspeed.nvme": "DeepSpeed's NVMe benchmarking tools",
    "deepspeed.io": "DeepSpeed's FastPersist file writers",
    "deepspeed.datastates": "DataStates asynchronous checkpointing",
    "deepspeed.checkpoint": "DeepSpeed's universal-checkpoint tools",
    "deepspeed.launcher": "DeepSpeed's launcher internals (zeroshard launch runs scripts)",
    "deepspeed.elasticity": "DeepSpeed elasticity",
    "deepspeed.comm": "DeepSpeed's communication internals",
    "deepspeed.accelerator": "DeepSpeed's accelerator back-ends other than CPU and CUDA",
    "deepspeed.ops": "DeepSpeed's compiled ops",
    "deepspeed.utils": "DeepSpeed's utility internals",
    "deepspeed": "DeepSpeed internals",
}


def feature_of(ds_module: str) -> str:
    """The feature (a phrase for messages and docs) that DeepSpeed module ``ds_module`` belongs to."""
    parts = ds_module.split(".")
    for n in range(len(parts), 0, -1):
        feature = FEATURES.get(".".join(parts[:n]))
        if feature is not None:
            return feature
    return FEATURES["deepspeed"]


def refuse(what: str, feature: str) -> NoReturn:
    raise NotImplementedError(
        f"{what} belongs to {feature}, which zeroshard does not provide (zeroshard is ZeRO data "
        f"parallelism with DeepSpeed's API); see {DOCS}"
    )


class _Default:
    """A default value the inventory only knows by its ``repr`` (an object, a function)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _default(text: str | None) -> Any:
    if text is None:
        return inspect.Parameter.empty
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _Default(text)
    return value if repr(value) == text else _Default(text)  # ``500,000,000`` is not a tuple


def signature_of(params: Sequence[Sequence[Any]] | None) -> inspect.Signature | None:
    """The :class:`inspect.Signature` an inventory entry describes (``None`` when DeepSpeed's is unknown)."""
    if params is None:
        return None
    return inspect.Signature(
        [
            inspect.Parameter(name, getattr(inspect.Parameter, kind), default=_default(default))
            for name, kind, default in params
        ]
    )


def refused_function(
    module: str, ds_module: str, name: str, entry: dict[str, Any], feature: str | None = None
) -> Callable[..., Any]:
    """DeepSpeed function ``ds_module.name`` as module ``module`` provides it: refused at use, naming
    ``feature`` (by default the feature of ``ds_module``)."""
    sig = signature_of(entry.get("signature"))
    feature = feature or feature_of(ds_module)

    def refused(*args: Any, **kwargs: Any) -> Any:
        if sig is not None:
            sig.bind(*args, **kwargs)  # a call DeepSpeed would reject fails the same way first
        refuse(f"{ds_module}.{name}()", feature)

    refused.__name__ = refused.__qualname__ = name
    refused.__module__ = module
    refused.__doc__ = f"DeepSpeed's ``{ds_module}.{name}``: refused at use ({feature})."
    refused.__signature__ = sig  # type: ignore[attr-defined]
    setattr(refused, MARK, "refused")
    return refused


class _RefusedMeta(type):
    """Metaclass of refused classes: DeepSpeed's public methods read on the class itself (or on a subclass)
    are refused too; for a class the inventory does not describe (``methods`` None), every public name."""

    def __getattr__(cls, attr: str) -> Any:
        refused = next((k.__dict__ for k in cls.__mro__ if "_deepspeed_name" in k.__dict__), None)
        if refused is not None and not attr.startswith("_"):
            methods = refused["_deepspeed_methods"]
            if methods is None or attr in methods:
                refuse(f"{refused['_deepspeed_name']}.{attr}", refused["_deepspeed_feature"])
        raise AttributeError(attr)


def refused_class(
    module: str, ds_module: str, name: str, entry: dict[str, Any], feature: str | None = None
) -> type:
    """DeepSpeed class ``ds_module.name`` as module ``module`` provides it: constructing it is refused,
    naming ``feature`` (by default the feature of ``ds_module``)."""
    feature = feature or feature_of(ds_module)
    qualified = f"{ds_module}.{name}"

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if sig is not None:
            sig.bind(*args, **kwargs)
        refuse(qualified, feature)

    sig = signature_of(entry.get("signature"))
    namespace = {
        "__init__": __init__,
        "__module__": module,
        "__doc__": f"DeepSpeed's ``{qualified}``: refused at use ({feature}).",
        "__signature__": sig,
        MARK: "refused",
        "_deepspeed_name": qualified,
        "_deepspeed_feature": feature,
        "_deepspeed_methods": entry.get("methods", {}),
    }
    return _RefusedMeta(name, (), namespace)


class RefusedObject:
    """A module-level DeepSpeed object (a timer, a logger instance) of a refused kind."""

    def __init__(self, qualified: str, feature: str) -> None:
        object.__setattr__(self, "_qualified", qualified)
        object.__setattr__(self, "_feature", feature)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        refuse(f"{self._qualified}.{attr}", self._feature)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        refuse(f"{self._qualified}()", self._feature)

    def __repr__(self) -> str:
        return f"<{self._qualified}: refused at use>"


RefusedObject.__zeroshard_surface__ = "refused"  # type: ignore[attr-defined]


def refusing_getattr(module: str, ds_module: str, feature: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for a DeepSpeed module left out of the inventory: any public name is a
    refused class (the most general stand-in: calling, constructing or reading a DeepSpeed attribute of it
    refuses; subclassing it at import works), made on first access and cached in the module."""

    def __getattr__(name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(f"module {ds_module!r} has no attribute {name!r}")
        value = refused_class(module, ds_module, name, {"signature": None, "methods": None}, feature)
        setattr(sys.modules[module], name, value)
        return value

    return __getattr__
