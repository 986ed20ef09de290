"""``deepspeed.moe.utils``: sorting parameters and optimizer groups into mixture-of-experts and dense ones.

zeroshard trains no MoE layers (``deepspeed.moe.layer.MoE`` cannot be built), but DeepSpeed-Chat and RLHF
code call these on every model to build their optimizer groups. They follow DeepSpeed 0.19's definitions:
an *expert parameter* is one with ``param.allreduce == False`` (what DeepSpeed's MoE layer sets), grouped
by its ``param.group_name``. On a model without MoE layers every parameter is dense, so the group helpers
return the groups they were given with each ``params`` turned into a list, and add no ``moe`` group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.moe.layer import MoE

__all__ = [
    "configure_moe_param_groups",
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]

# DeepSpeed's default cap on the elements of one expert param group (2**31 / 12, rounded).
DEFAULT_MAX_GROUP_SIZE = 178956971


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """``(True, num_experts)`` of the first ``MoE`` layer in ``m``; ``(False, 0)`` when it has none."""
    for module in m.modules():
        if isinstance(module, MoE):
            return True, cast(int, module.num_experts)
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert parameter: it carries ``allreduce`` and that is false."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(
    params: list[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(dense, expert)``: ``params`` in their order, split by :func:`is_moe_param`."""
    shared = [p for p in params if not is_moe_param(p)]
    expert = [p for p in params if is_moe_param(p)]
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
    group: list[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(dense gradients, expert gradients)`` of the parameters in ``group`` that have one, each cast to
    its parameter's dtype."""
    shared: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | float | None = DEFAULT_MAX_GROUP_SIZE,
) -> list[dict[str, Any]]:
    """Move expert parameters out of ``param_groups`` into groups of their own, one per (group, expert
    group name), flagged ``moe=True``, and return the list of groups.

    As in DeepSpeed: a list is changed in place and returned, a tuple or a single dict is put in a new
    list; every group's ``params`` becomes a list of its dense parameters; each expert group copies its
    source group's options, takes ``name`` = the expert group's name and is cut into pieces of at most
    ``max_group_size`` elements (``ds_numel`` where set), or kept whole with ``max_group_size=None``. A
    group that holds expert parameters needs a ``name`` (the key expert groups are made under). Unlike
    DeepSpeed 0.19, a group whose ``params`` is an iterator (``model.parameters()``) keeps its parameters:
    DeepSpeed reads it twice and so silently empties the group.

    Raises:
        ValueError: ``param_groups`` is not a dict, tuple or list.
    """
    if isinstance(param_groups, tuple):
        groups = list(param_groups)
    elif isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, list):
        groups = param_groups
    else:
        raise ValueError(
            f"split_params_into_different_moe_groups_for_optimizer(param_groups=...): got "
            f"{type(param_groups).__name__}; expected a dict, a tuple or a list of param group dicts"
        )
    for group in groups:
        params = group["params"]
        group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
    expert_names = sorted({p.group_name for g in groups for p in g["params"] if is_moe_param(p)})
    if not expert_names:
        return groups  # a model without MoE layers: nothing moves
    # One expert group per (source group name, expert group name), in DeepSpeed's order.
    expert_groups: dict[str, dict[str, dict[str, Any]]] = {}
    for group in groups:
        expert_groups[group["name"]] = {
            name: {**group, "name": name, "moe": True, "params": []} for name in expert_names
        }
    for group in groups:
        dense = []
        for p in group["params"]:
            if is_moe_param(p):
                expert_groups[group["name"]][p.group_name]["params"].append(p)
            else:
                dense.append(p)
        group["params"] = dense
    for by_name in expert_groups.values():
        for expert in by_name.values():
            if max_group_size is None:
                groups.append(expert)
                continue
            for piece in _cut(expert["params"], max_group_size):
                groups.append({**expert, "params": piece})
    return groups


def _cut(params: list[nn.Parameter], max_elements: int | float) -> list[list[nn.Parameter]]:
    """``params`` in order, in consecutive pieces of at most ``max_elements`` elements, as DeepSpeed cuts
    them: a parameter that does not fit closes the current piece, even an empty one (so a first parameter
    larger than ``max_elements`` leaves an empty piece before its own)."""
    pieces: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        numel = int(getattr(p, "ds_numel", p.numel()))
        if size + numel <= max_elements:
            current.append(p)
            size += numel
        else:
            pieces.append(current)
            current, size = [p], numel
    if current:
        pieces.append(current)
    return pieces


def is_moe_param_group(param_group: Mapping[str, Any]) -> bool:
    """Whether ``param_group`` is an expert group (its ``moe`` flag; absent: no)."""
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]]:
    """Optimizer groups ready for MoE from ``model_parameters``, a list of tensors or of group dicts.

    Tensors become one group named ``"dense-params"`` and go through
    :func:`split_params_into_different_moe_groups_for_optimizer`; group dicts go through it too unless
    one of them already has a ``moe`` key, and are then returned as they are.

    Raises:
        TypeError: ``model_parameters`` is not a list, or holds something that is neither a tensor nor a
            dict.
        ValueError: ``model_parameters`` is empty.
    """
    if not isinstance(model_parameters, list):
        raise TypeError(
            f"configure_moe_param_groups(model_parameters=...): got {type(model_parameters).__name__}; "
            "expected a list of tensors or of param group dicts"
        )
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError(
                "configure_moe_param_groups(model_parameters=...): the optimizer takes tensors or param "
                f"group dicts, got {type(p).__name__}"
            )
    if not model_parameters:
        raise ValueError("configure_moe_param_groups(model_parameters=[]): no parameters")
    if isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"}
        )
    if any("moe" in group for group in model_parameters):
        return model_parameters  # the MoE groups exist already
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
