"""``deepspeed.runtime.config``: ``DeepSpeedConfig``, a loaded ds_config as DeepSpeed's class presents it."""

from __future__ import annotations

from typing import Any

from zeroshard.config import ZeroshardConfig, load_config
from zeroshard.config.errors import Problems
from zeroshard.config.resolve import TRIAD, resolve_batch
from zeroshard.deepspeed import surface
from zeroshard.deepspeed.comm import get_rank, get_world_size
from zeroshard.deepspeed.monitor.config import DeepSpeedMonitorConfig, get_monitor_config
from zeroshard.deepspeed.runtime.precision_config import (
    DeepSpeedBF16Config,
    DeepSpeedFP16Config,
    get_bfloat16_config,
    get_float16_config,
)
from zeroshard.deepspeed.runtime.zero.config import DeepSpeedZeroConfig, get_zero_config
from zeroshard.errors import DeepSpeedConfigError
from zeroshard.runtime.methods import config_optimizer_name
from zeroshard.runtime.query_table import QUERIES

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]


class DeepSpeedConfig:
    """A ds_config (a dict, or a JSON/Hjson/base64 path), loaded and validated for this world size as
    DeepSpeed's class does.

    Its keys read as attributes and items, as zeroshard's :class:`~zeroshard.config.ZeroshardConfig` gives
    them (``cfg.zero_optimization.stage``, ``cfg["gradient_clipping"]``, the batch sizes resolved), and
    DeepSpeed's derived attributes are there too: ``zero_config``, ``zero_enabled``,
    ``zero_optimization_stage``, ``float16_config``, ``bfloat16_config``, ``monitor_config``,
    ``optimizer_name``, ``optimizer_params``, ``scheduler_name``, ``scheduler_params``, ``world_size``,
    ``global_rank`` and ``_param_dict`` (the config as a dict). ``config`` is the ``ZeroshardConfig``.
    """

    def __init__(self, config: str | dict[str, Any], mpu: Any = None, mesh_device: Any = None) -> None:
        if mpu is not None:
            raise ValueError("DeepSpeedConfig(mpu=...): model parallelism is not supported by zeroshard")
        self.world_size = get_world_size()
        self.global_rank = get_rank()
        self.config: ZeroshardConfig = load_config(config, world_size=self.world_size)
        self._param_dict: dict[str, Any] = self.config.to_dict()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "config":
            raise AttributeError(name)
        try:
            return getattr(self.config, name)
        except AttributeError:
            raise AttributeError(
                f"DeepSpeedConfig has no attribute {name!r} in zeroshard: read the ds_config's keys "
                "(cfg.<key>, cfg['<key>'])"
            ) from None

    def _configure_train_batch_size(self) -> None:
        """DeepSpeed's batch resolution over ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and
        ``gradient_accumulation_steps`` as they are set on this object now (None: not given), as
        :func:`~zeroshard.config.load_config` resolves them: the missing ones inferred, the three checked
        together for ``world_size``, and written back.

        Raises:
            ConfigError: the sizes do not add up, or too few are given (also DeepSpeed's ``AssertionError``).
        """
        given = {key: value for key in TRIAD if (value := getattr(self, key)) is not None}
        problems = Problems()
        sizes = resolve_batch(given, self.world_size, problems)
        problems.raise_if_any("DeepSpeedConfig batch sizes")
        if sizes is not None:
            self.train_batch_size = sizes.train
            self.train_micro_batch_size_per_gpu = sizes.micro
            self.gradient_accumulation_steps = sizes.gas

    def __getitem__(self, key: str) -> Any:
        return self.config[key]

    def __contains__(self, key: object) -> bool:
        return key in self.config

    @property
    def zero_config(self) -> DeepSpeedZeroConfig:
        return get_zero_config(self._param_dict)

    @property
    def zero_optimization_stage(self) -> int:
        return int(self.config.zero_optimization.stage)

    @property
    def zero_enabled(self) -> bool:
        return self.zero_optimization_stage > 0

    @property
    def float16_config(self) -> DeepSpeedFP16Config:
        return get_float16_config(self._param_dict)

    @property
    def bfloat16_config(self) -> DeepSpeedBF16Config:
        return get_bfloat16_config(self._param_dict)

    @property
    def monitor_config(self) -> DeepSpeedMonitorConfig:
        return get_monitor_config(self._param_dict)

    @property
    def optimizer_name(self) -> str | None:
        return config_optimizer_name(self.config)

    # As the engine's queries of the same names read them (runtime/query_table.py).
    @property
    def optimizer_params(self) -> dict[str, Any] | None:
        return QUERIES["optimizer_params"].read(self.config)  # type: ignore[no-any-return]

    @property
    def scheduler_name(self) -> str | None:
        return QUERIES["scheduler_name"].read(self.config)  # type: ignore[no-any-return]

    @property
    def scheduler_params(self) -> dict[str, Any] | None:
        return QUERIES["scheduler_params"].read(self.config)  # type: ignore[no-any-return]


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
