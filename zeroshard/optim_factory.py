"""Build the optimizer that a ds_config's ``optimizer`` block names, over zeroshard's shards.

The engine hands every optimizer 1-D tensors: views into the flat fp32 master buffer, either
whole parameters (stage 0) or this rank's slice of them (stages 1-3). An optimizer gives the
same numbers as on the original model only if its update is *elementwise* — every output
element depends on the same element of the inputs and on nothing else. Each optimizer type is
therefore one of:

- elementwise (Adam, AdamW, SGD, Adagrad, Lion, most of torch.optim): any stage;
- whole-parameter (Lamb, whose trust ratio uses norms of each parameter): stage 0 only;
- refused (LBFGS, SparseAdam, Adafactor, DeepSpeed's 1-bit and mup optimizers, Muon).

Type names follow DeepSpeed's ``_configure_basic_optimizer`` and match case-insensitively.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from zeroshard.config.params import (
    check_keys,
    check_value,
    checked_kwargs,
    keyword_defaults,
    resolve_name,
)
from zeroshard.optimizers import DeepSpeedCPUAdam, FusedAdam, Lamb, Lion

__all__ = ["build_optimizer", "check_optimizer_for_stage"]

log = logging.getLogger(__name__)

_SECTION = "optimizer.params"

#: torch.optim classes whose update is elementwise, so exact on any shard of a parameter.
_ELEMENTWISE_TORCH = (
    "ASGD",
    "Adadelta",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "SGD",
)

#: Optimizers that need every tensor they step to be a whole parameter.
_WHOLE_PARAMETER: tuple[type[torch.optim.Optimizer], ...] = (Lamb,)

#: Types zeroshard refuses, with the reason; keys are the names users write.
_REFUSED = {
    "LBFGS": "it re-evaluates the loss through a closure several times per step, which the "
    "engine's step does not provide",
    "SparseAdam": "it needs sparse gradients, and zeroshard reduces gradients into dense flat buffers",
    "Adafactor": "it factors the second moment over each parameter's rows and columns, and "
    "zeroshard hands optimizers flat 1-D views, so the result would differ at every stage",
    "Muon": "it orthogonalises each 2-D weight as a whole (DeepSpeed's and torch's Muon alike), "
    "and zeroshard hands optimizers flat 1-D views",
    "OneBitAdam": "it needs DeepSpeed's compressed 1-bit collectives, which DeepSpeed itself does "
    "not combine with ZeRO",
    "ZeroOneAdam": "it needs DeepSpeed's compressed 1-bit collectives, which DeepSpeed itself does "
    "not combine with ZeRO",
    "OneBitLamb": "it needs DeepSpeed's compressed 1-bit collectives, which DeepSpeed itself does "
    "not combine with ZeRO",
    "MuAdam": "it needs the `mup` package's parameter shapes",
    "MuAdamW": "it needs the `mup` package's parameter shapes",
    "MuSGD": "it needs the `mup` package's parameter shapes",
}

_SUPPORTED = tuple(dict.fromkeys(("Adam", "AdamW", "Lamb", "Lion", *_ELEMENTWISE_TORCH)))

#: The Adam hyperparameters DeepSpeed's classes and torch's take alike; any other torch key asks for torch's.
_ADAM_SHARED_KEYS = ("lr", "betas", "eps", "weight_decay")

#: DeepSpeed-only Adam keys: read here, never passed to the optimizer class.
_ADAM_DEEPSPEED_KEYS = ("adam_w_mode", "bias_correction", "fused", "set_grad_none", "torch_adam")


def build_optimizer(
    type_name: str,
    params: Mapping[str, Any],
    param_groups: list[dict[str, Any]],
    *,
    stage: int,
    offloaded: bool = False,
) -> torch.optim.Optimizer:
    """Build the optimizer for ``{"optimizer": {"type": type_name, "params": params}}``.

    Follows DeepSpeed's mapping:

    - ``Adam``: DeepSpeed's class, :class:`~zeroshard.optimizers.FusedAdam` (with ``offloaded``,
      :class:`~zeroshard.optimizers.DeepSpeedCPUAdam`): decoupled weight decay unless ``adam_w_mode``
      is false, then L2; ``bias_correction`` as given. ``AdamW`` is always decoupled; DeepSpeed ignores
      ``adam_w_mode: false`` there, and so does this (with a warning). Defaults are DeepSpeed
      FusedAdam's: lr 1e-3, betas (0.9, 0.999), eps 1e-8 and **weight_decay 0.0** (torch.optim.AdamW's
      own default is 0.01). Both classes run torch's fused kernel and equal torch.optim.AdamW (Adam)
      with ``fused=True`` ([Note: DeepSpeed's Adam classes]). With ``torch_adam: true`` DeepSpeed uses
      torch's class with torch's defaults, and so does this; so does an option only torch's class has
      (``amsgrad``, ``foreach``, ``maximize``, ``capturable``, ``differentiable``), which is passed on.
      ``torch_adam``, ``adam_w_mode``, ``fused`` and ``set_grad_none`` are read here, not passed on.
    - ``Lamb``: :class:`~zeroshard.optimizers.Lamb` (DeepSpeed FusedLamb); stage 0 only.
    - ``Lion``: :class:`~zeroshard.optimizers.Lion` (DeepSpeed FusedLion's defaults).
    - ``Adagrad``, ``SGD`` and the other elementwise torch.optim classes: that class with
      torch's defaults.

    ``max_grad_norm`` is refused, as in DeepSpeed: clipping is ``gradient_clipping``.

    Args:
        type_name: ``optimizer.type``; case-insensitive.
        params: ``optimizer.params``; lists are accepted where the class wants tuples.
        param_groups: Groups of 1-D tensors (leaf, not requiring grad; ``.grad`` set by the
            engine, None for a parameter without gradient, which is then skipped). For a
            whole-parameter optimizer (Lamb) each tensor must be one whole parameter.
        stage: ZeRO stage, 0-3.
        offloaded: The optimizer steps in CPU memory (``offload_optimizer``): ``Adam`` is DeepSpeed's CPU
            class, as in DeepSpeed.

    Returns:
        The optimizer, constructed over ``param_groups``.

    Raises:
        TypeError: A value has the wrong type; the message names ``optimizer.params.<key>``.
        ValueError: Unknown or refused type, unknown key (with did-you-mean and the accepted
            keys), a value the class rejects, or Lamb at stage >= 1.
    """
    name = resolve_name("optimizer.type", type_name, (*_SUPPORTED, *_REFUSED), "optimizer", shown=_SUPPORTED)
    if name in _REFUSED:
        raise ValueError(
            f"optimizer.type: {type_name!r} is not available in zeroshard: {_REFUSED[name]}. "
            f"Available: {', '.join(_SUPPORTED)}."
        )
    if "max_grad_norm" in params:
        raise ValueError(
            f"{_SECTION}.max_grad_norm: not supported as an optimizer parameter (DeepSpeed refuses "
            "it too); set the top-level `gradient_clipping` instead"
        )
    if name in ("Adam", "AdamW"):
        cls, kwargs = _adam_kwargs(name, params, DeepSpeedCPUAdam if offloaded else FusedAdam)
        check_optimizer_for_stage(cls, stage, type_label=name)
    else:
        cls = {"Lamb": Lamb, "Lion": Lion}.get(name) or getattr(torch.optim, name)
        check_optimizer_for_stage(cls, stage, type_label=name)
        kwargs = _class_kwargs(cls, name, params)
    return _construct(cls, name, param_groups, kwargs)


def check_optimizer_for_stage(cls: type[torch.optim.Optimizer], stage: int, *, type_label: str) -> None:
    """Refuse optimizers that would not be exact at ZeRO ``stage``.

    Args:
        cls: The optimizer class.
        stage: ZeRO stage, 0-3.
        type_label: Name used in the message (the config's ``optimizer.type`` or a class name).

    Raises:
        TypeError: ``stage`` is not an int.
        ValueError: ``stage`` is not 0-3; or ``cls`` needs whole parameters and ``stage`` >= 1;
            or ``cls`` is one zeroshard refuses at every stage.
    """
    if not isinstance(stage, int) or isinstance(stage, bool):
        raise TypeError(f"zero_optimization.stage: expected an int 0-3, got {stage!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage: expected 0, 1, 2 or 3, got {stage}")
    if cls.__module__.startswith("torch.optim") and cls.__name__ in _REFUSED:
        raise ValueError(f"{type_label} is not available in zeroshard: {_REFUSED[cls.__name__]}.")
    if stage >= 1 and issubclass(cls, _WHOLE_PARAMETER):
        raise ValueError(
            f"optimizer.type: {type_label!r} needs whole-parameter norms for its trust ratio, and "
            f"ZeRO stage {stage} splits parameters across ranks, so each rank would see only part "
            "of a parameter. Use zero_optimization.stage 0, or an elementwise optimizer such as AdamW."
        )


def _adam_kwargs(
    name: str, params: Mapping[str, Any], kernel: type[torch.optim.Optimizer]
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """Choose the Adam class as DeepSpeed does and return it with checked kwargs: ``kernel`` (FusedAdam or
    DeepSpeedCPUAdam) unless torch's class is asked for, by ``torch_adam`` or by an option only it has."""
    rest = dict(params)
    torch_adam = _pop_bool(rest, "torch_adam", False)
    adam_w_mode = _pop_bool(rest, "adam_w_mode", True)
    bias_correction = _pop_bool(rest, "bias_correction", True)
    for key in ("fused", "set_grad_none"):
        if key in rest:
            log.debug("%s.%s=%r is a DeepSpeed kernel option; zeroshard ignores it", _SECTION, key, rest[key])
            _pop_bool(rest, key, False)
    if name == "AdamW" and not adam_w_mode:
        log.warning(
            "%s.adam_w_mode=false is ignored for optimizer.type 'AdamW' (as in DeepSpeed); "
            "use type 'Adam' with adam_w_mode false for L2 weight decay",
            _SECTION,
        )
    decoupled = name == "AdamW" or adam_w_mode

    cls: type[torch.optim.Optimizer]
    if bias_correction:
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        accepted = keyword_defaults(cls.__init__, skip=("params", "fused", "decoupled_weight_decay"))
    else:
        if torch_adam:
            raise ValueError(
                f"{_SECTION}.bias_correction: false cannot be combined with torch_adam true "
                "(torch's Adam always bias-corrects; DeepSpeed fails on this too); drop torch_adam"
            )
        if check_value(f"{_SECTION}.amsgrad", rest.pop("amsgrad", False), False):
            raise ValueError(
                f"{_SECTION}.amsgrad: true needs bias_correction true (DeepSpeed's FusedAdam "
                "supports neither combination)"
            )
        cls = kernel
        accepted = {k: v for k, v in keyword_defaults(FusedAdam.__init__).items() if k in _ADAM_SHARED_KEYS}
    owner = f"{_class_label(cls)} [optimizer.type {name!r}]"
    check_keys(_SECTION, rest, [*accepted, *_ADAM_DEEPSPEED_KEYS], owner)
    kwargs = checked_kwargs(_SECTION, rest, accepted)
    if not torch_adam:
        kwargs.setdefault("weight_decay", 0.0)  # DeepSpeed FusedAdam's default, not AdamW's 0.01
    torch_only = {k: v for k, v in kwargs.items() if k not in _ADAM_SHARED_KEYS}
    if not torch_adam and not any(torch_only.values()):
        # DeepSpeed's class (fused_adam.py [Note: DeepSpeed's Adam classes]): torch's fused kernel, as fast as
        # DeepSpeed's compiled CPU Adam on our shards (bench/cpu_adam.py), 3-4x torch's default CPU loop.
        kept = {k: v for k, v in kwargs.items() if k not in torch_only}
        mode = "adamw_mode" if kernel is DeepSpeedCPUAdam else "adam_w_mode"  # DeepSpeed's two spellings
        return kernel, {**kept, "bias_correction": bias_correction, mode: decoupled}
    if not any(kwargs.get(k) for k in ("foreach", "differentiable", "capturable")):
        kwargs["fused"] = True  # torch's class, still on the fused kernel
    return cls, kwargs


def _class_kwargs(cls: type[torch.optim.Optimizer], name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Check ``params`` against ``cls``'s constructor and return them as kwargs."""
    rest = dict(params)
    if cls is Lion:
        _pop_bool(rest, "set_grad_none", True)  # a DeepSpeed FusedLion kernel option
    if cls is Lamb and check_value(f"{_SECTION}.amsgrad", rest.pop("amsgrad", False), False):
        raise ValueError(f"{_SECTION}.amsgrad: Lamb has no AMSGrad variant (nor does DeepSpeed's FusedLamb)")
    accepted = keyword_defaults(cls.__init__, skip=("params",))
    owner = f"{_class_label(cls)} [optimizer.type {name!r}]"
    check_keys(_SECTION, rest, accepted, owner)
    return checked_kwargs(_SECTION, rest, accepted)


def _construct(
    cls: type[torch.optim.Optimizer], name: str, param_groups: list[dict[str, Any]], kwargs: dict[str, Any]
) -> torch.optim.Optimizer:
    """Call ``cls(param_groups, **kwargs)``, prefixing value errors with the config section."""
    log.debug("building %s for optimizer.type %r with %s", cls.__qualname__, name, kwargs)
    try:
        return cls(param_groups, **kwargs)
    except ValueError as error:
        raise ValueError(f"{_SECTION}: {cls.__qualname__} rejected {kwargs}: {error}") from error


def _pop_bool(params: dict[str, Any], key: str, default: bool) -> bool:
    """Remove ``key`` from ``params`` and return it, checked to be a bool."""
    value: bool = check_value(f"{_SECTION}.{key}", params.pop(key, default), default)
    return value


def _class_label(cls: type) -> str:
    """Return ``torch.optim.AdamW`` for torch's classes, ``module.Qualname`` for others."""
    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"
