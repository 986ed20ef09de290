"""What ``import deepspeed``'s helpers return, as JSON: run once under real DeepSpeed and once with
``ZEROSHARD_AS_DEEPSPEED=1``, tests/test_deepspeed_semantics.py asserts the two files are equal.

Covers ``deepspeed.utils.RepeatingLoader``, ``recursive_getattr`` / ``recursive_setattr`` (from
``deepspeed.compression.helper`` and ``deepspeed.utils``), ``deepspeed.moe.utils`` on a model without MoE
layers and with parameters marked as experts, and ``deepspeed.runtime.zero.offload_config``'s enums and
config classes. Parameters are written as their names, groups as sorted dicts. One process, no
distributed group.

    python semantics_probe.py OUT.json
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)  # the helper module is deprecated in both
    from deepspeed.compression.helper import recursive_getattr, recursive_setattr

import deepspeed.utils
from deepspeed.moe import utils as moe
from deepspeed.runtime.dataloader import RepeatingLoader
from deepspeed.runtime.zero import offload_config


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Sequential(nn.Tanh(), nn.Linear(5, 2)), nn.LayerNorm(2))


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _groups(groups: list[dict[str, Any]], names: dict[int, str]) -> list[dict[str, Any]]:
    out = []
    for group in groups:
        row = {k: v for k, v in sorted(group.items()) if k != "params"}
        row["params"] = [names[id(p)] for p in group["params"]]
        out.append(row)
    return out


def loaders() -> dict[str, Any]:
    rl = RepeatingLoader(DataLoader(list(range(5)), batch_size=2))
    return {
        "same_class": deepspeed.utils.RepeatingLoader is RepeatingLoader,
        "iter_is_self": iter(rl) is rl,
        "seven": [next(rl).tolist() for _ in range(7)],
        "plain_list": [next(r) for r in [RepeatingLoader([1, 2])] for _ in range(5)],
    }


def module_utils() -> dict[str, Any]:
    model = _model()
    got = recursive_getattr(model, "1.1.weight")
    recursive_setattr(model, "1.0", nn.ReLU())
    recursive_setattr(model, "2", nn.Identity())
    return {
        "same_functions": [
            deepspeed.utils.recursive_getattr is recursive_getattr,
            deepspeed.utils.recursive_setattr is recursive_setattr,
        ],
        "shape": list(got.shape),
        "is_param": got is model[1][1].weight,
        "modules": [f"{n}:{type(m).__name__}" for n, m in model.named_modules()],
        "params": [n for n, _ in model.named_parameters()],
    }


def moe_dense() -> dict[str, Any]:
    model = _model()
    names = _names(model)
    params = list(model.parameters())
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    as_list = [{"params": decay, "name": "d", "weight_decay": 0.1}, {"params": rest, "name": "r", "lr": 0.5}]
    split_list = moe.split_params_into_different_moe_groups_for_optimizer(as_list)
    as_dict = {"params": params, "name": "all"}
    split_dict = moe.split_params_into_different_moe_groups_for_optimizer(as_dict)
    as_tuple = ({"params": decay, "name": "d"}, {"params": rest, "name": "r"})
    shared, expert = moe.split_params_into_shared_and_expert_params(params)
    return {
        "has_moe_layers": list(moe.has_moe_layers(model)),
        "is_moe_param": [moe.is_moe_param(p) for p in params],
        "list": _groups(split_list, names),
        "list_in_place": split_list is as_list,
        "dict": _groups(split_dict, names),
        "dict_in_result": split_dict[0] is as_dict,
        "tuple": _groups(moe.split_params_into_different_moe_groups_for_optimizer(as_tuple), names),
        "no_cap": _groups(moe.split_params_into_different_moe_groups_for_optimizer(as_list, None), names),
        "configure_params": _groups(moe.configure_moe_param_groups(params), names),
        "configure_groups": _groups(moe.configure_moe_param_groups([{"params": decay}]), names),
        "is_moe_param_group": [moe.is_moe_param_group(g) for g in [*split_list, {"moe": True}]],
        "shared": [names[id(p)] for p in shared],
        "expert": [names[id(p)] for p in expert],
    }


def moe_experts() -> dict[str, Any]:
    """Parameters marked as DeepSpeed's MoE layer marks its experts (one expert group: DeepSpeed orders
    several by a set)."""
    model = _model()
    names = _names(model)
    for p in (model[0].weight, model[0].bias, model[1][1].weight):
        p.allreduce = False
        p.group_name = "ep_size_2"
    for p in (model[2].weight,):
        p.allreduce = True
    model[0].weight.grad = torch.ones(5, 3)
    model[2].bias.grad = torch.full((2,), 2.0)
    groups = [
        {"params": [model[0].weight, model[1][1].weight, model[2].weight], "name": "a", "weight_decay": 0.1},
        {"params": [model[0].bias, model[1][1].bias, model[2].bias], "name": "b"},
    ]
    split = moe.split_params_into_different_moe_groups_for_optimizer(groups, max_group_size=12)
    marked = [{"params": [model[0].bias], "name": "m", "moe": False}]
    shared_grads, expert_grads = moe.split_params_grads_into_shared_and_expert_params(
        list(model.parameters())
    )
    return {
        "is_moe_param": [moe.is_moe_param(p) for p in model.parameters()],
        "split_capped": _groups(split, names),
        "is_moe_param_group": [moe.is_moe_param_group(g) for g in split],
        "configure_existing": _groups(moe.configure_moe_param_groups(marked), names),
        "grads": [[g.tolist() for g in shared_grads], [g.tolist() for g in expert_grads]],
    }


def offload() -> dict[str, Any]:
    param = offload_config.DeepSpeedZeroOffloadParamConfig(device="cpu", pin_memory=False)
    opt = offload_config.DeepSpeedZeroOffloadOptimizerConfig(device="nvme", nvme_path="/tmp/x", ratio=0.5)
    auto = offload_config.DeepSpeedZeroOffloadParamConfig(False, device="auto", buffer_count="auto")
    return {
        "devices": [[m.name, m.value, isinstance(m, str)] for m in offload_config.OffloadDeviceEnum],
        "states": [[m.name, m.value, isinstance(m, str)] for m in offload_config.OffloadStateTypeEnum],
        "param": [
            str(offload_config.OffloadDeviceEnum(param.device).value),
            param.pin_memory,
            param.buffer_count,
            param.buffer_size,
            param.max_in_cpu,
            param.nvme_path,
        ],
        "optimizer": [
            str(offload_config.OffloadDeviceEnum(opt.device).value),
            str(opt.nvme_path),
            opt.buffer_count,
            opt.pin_memory,
            opt.pipeline_read,
            opt.fast_init,
            opt.ratio,
        ],
        "equal": [param.device == offload_config.OffloadDeviceEnum.cpu, opt.device == "nvme"],
        "auto": [str(offload_config.OffloadDeviceEnum(auto.device).value), auto.buffer_count],
    }


if __name__ == "__main__":
    report = {
        "loaders": loaders(),
        "module_utils": module_utils(),
        "moe_dense": moe_dense(),
        "moe_experts": moe_experts(),
        "offload": offload(),
    }
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
