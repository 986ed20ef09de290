"""DeepSpeed's engine methods zeroshard does not provide, refused at use by name.

``DeepSpeedSurface.__getattr__`` asks :func:`refused_method` for a name that is neither the engine's nor
its module's: for a ``DeepSpeedEngine`` method (``inventory.json``) that is a function with DeepSpeed's
signature which raises ``NotImplementedError`` naming ``DeepSpeedEngine.<name>``, its feature and
docs/porting.md#refused-at-use when called. ``hasattr(engine, name)`` stays true, as on DeepSpeed's engine,
and a call DeepSpeed would reject raises its ``TypeError`` first. The config queries and behaviour methods
zeroshard does provide are in queries.py and methods.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["refused_method"]

_REFUSED_FEATURES: dict[str, tuple[str, ...]] = {
    "DeepCompile (engine.compile() runs torch.compile)": (
        "get_autosp_backend",
        "get_autotp_backend",
        "get_compile_time",
        "get_deepcompile_backend",
        "get_deepspeed_compile_backend",
        "register_compile_pass",
    ),
    "data efficiency (curriculum learning, data sampling, random-LTD)": (
        "random_ltd_initialize",
        "set_custom_curriculum_learning_schedule",
        "set_data_post_process_func",
    ),
    "sequence parallelism (Ulysses)": ("get_sequence_parallel_group",),
    "mixture of experts": ("load_moe_state_dict", "print_forward_breakdown"),
    "DeepSpeed's NVMe swapper internals (zeroshard's offload replaces them)": ("swap_tensor_config",),
    "DeepSpeed's data loader (initialize(training_data=...) builds zeroshard's)": ("deepspeed_io",),
}
_ENGINE_INTERNALS = (
    "DeepSpeed's engine internals (zeroshard's engine reduces, clips and times the step itself; "
    "wall_clock_breakdown logs its timings)"
)


def _feature(name: str) -> str:
    return next((f for f, names in _REFUSED_FEATURES.items() if name in names), _ENGINE_INTERNALS)


@functools.cache
def refused_method(name: str) -> Callable[..., Any] | None:
    """``engine.<name>`` for a ``DeepSpeedEngine`` method zeroshard does not provide: a function with
    DeepSpeed's signature that raises ``NotImplementedError`` naming ``DeepSpeedEngine.<name>`` when called
    (a call DeepSpeed would reject raises its ``TypeError`` first). None for a name DeepSpeed's engine does
    not have; a DeepSpeed *property* is refused at once.
    """
    from zeroshard.deepspeed.refusals import MARK, refuse, signature_of  # lazily: they import the engine
    from zeroshard.deepspeed.surface import inventory

    engine = inventory()["modules"]["deepspeed.runtime.engine"]["names"]["DeepSpeedEngine"]
    params = engine["methods"].get(name)
    if params is None:
        return None
    what, feature = f"DeepSpeedEngine.{name}", _feature(name)
    if params == "property":
        refuse(what, feature)
    if params and params[0][0] == "self":
        params = params[1:]  # bound to the engine
    sig = signature_of(params)

    def refused(*args: Any, **kwargs: Any) -> Any:
        if sig is not None:
            sig.bind(*args, **kwargs)
        refuse(f"{what}()", feature)

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"DeepSpeed's ``{what}``: refused at use ({feature})."
    refused.__signature__ = sig  # type: ignore[attr-defined]
    setattr(refused, MARK, "refused")
    return refused
