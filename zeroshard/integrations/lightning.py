"""Lightning on zeroshard without the ``import deepspeed`` alias: ``ZeroshardStrategy`` and its names.

    import zeroshard.integrations.lightning  # registers "zeroshard", "zeroshard_stage_1", ... (below)
    trainer = lightning.Trainer(strategy="zeroshard_stage_3", ...)
    trainer = lightning.Trainer(strategy=ZeroshardStrategy(stage=2, offload_optimizer=True), ...)

[Note: lightning strategy]
``ZeroshardStrategy`` *is* Lightning's ``DeepSpeedStrategy`` (a subclass), so everything Lightning does for
DeepSpeed happens for it too: the DeepSpeed precision plugin, the ZeRO-3 model summary (``ds_numel``,
``partition_numel``), sharded checkpoints through the engine's ``save_checkpoint`` / ``load_checkpoint`` (a
directory per checkpoint), ``configure_model`` under ``zero.Init`` at stage 3, gradient accumulation and
clipping by the engine. Only the places where ``DeepSpeedStrategy`` runs ``import deepspeed`` are overridden,
each to call the same function of ``zeroshard.deepspeed`` instead, so a real DeepSpeed, installed or not, is
never imported; and ``__init__`` skips Lightning's "is DeepSpeed installed" check and sets the attributes
``DeepSpeedStrategy.__init__`` sets (tests/test_integration_lightning.py checks that list against Lightning's
source). Unlike Lightning's DeepSpeed strategy it also runs on the CPU accelerator (gloo), as zeroshard does.

Arguments have ``DeepSpeedStrategy``'s names and defaults. Those that change nothing in zeroshard raise
``ValueError`` when given a value other than the default (see ``NO_EFFECT``).
"""

from __future__ import annotations

import argparse
import logging
import platform
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.strategies.deepspeed import _validate_device_index_selection
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.strategies.deepspeed import remove_module_hooks
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.optim import Optimizer

import zeroshard.deepspeed as zs_deepspeed
from zeroshard.checkpoint import get_fp32_state_dict, open_checkpoint
from zeroshard.core.comm import DEFAULT_TIMEOUT

__all__ = ["NO_EFFECT", "STRATEGY_NAMES", "ZeroshardStrategy", "convert_zero_checkpoint_to_fp32_state_dict"]

logger = logging.getLogger(__name__)

NO_EFFECT: dict[str, Any] = {
    # zeroshard trains with any torch optimizer: there is nothing untested to allow or refuse
    "zero_allow_untested_optimizer": True,
    # gradients always land in flat per-unit buffers; updated shards are always all-gathered
    "contiguous_gradients": True,
    "allgather_partitions": True,
    # NVMe parameter offload: swap buffers are sized per unit; every shard swaps, none stays in CPU memory
    "params_buffer_size": 100_000_000,
    "max_in_cpu": 1_000_000_000,
    # NVMe I/O: requests are always batched and completion always overlaps submission
    "single_submit": False,
    "overlap_events": True,
    # DeepSpeed's activation-partitioning switches: data parallel only, nothing to partition or move
    "partition_activations": False,
    "cpu_checkpointing": False,
    "contiguous_memory_optimization": False,
    "synchronize_checkpoint_boundary": False,
}
"""``DeepSpeedStrategy`` arguments without an effect in zeroshard, with Lightning's default (accepted)."""

# name -> (description, ZeroshardStrategy keyword arguments)
STRATEGY_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "zeroshard": ("zeroshard, ZeRO stage 2", {}),
    "zeroshard_stage_1": ("zeroshard, ZeRO stage 1", {"stage": 1}),
    "zeroshard_stage_2": ("zeroshard, ZeRO stage 2", {"stage": 2}),
    "zeroshard_stage_2_offload": (
        "zeroshard, ZeRO stage 2, optimizer offloaded to CPU",
        {"stage": 2, "offload_optimizer": True},
    ),
    "zeroshard_stage_3": ("zeroshard, ZeRO stage 3", {"stage": 3}),
    "zeroshard_stage_3_offload": (
        "zeroshard, ZeRO stage 3, optimizer and parameters offloaded to CPU",
        {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
    ),
}


class ZeroshardStrategy(DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` running on zeroshard (see [Note: lightning strategy]).

    Invariant: no method imports ``deepspeed``; every DeepSpeed call goes to ``zeroshard.deepspeed``.
    The engine (``self.model`` after setup, ``deepspeed_engine``) is a :class:`zeroshard.ZeroshardEngine`.
    """

    strategy_name = "zeroshard"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        zero_optimization: bool = True,
        stage: int = 2,
        remote_device: str | None = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        offload_params_device: str = "cpu",
        nvme_path: str = "/local_nvme",
        params_buffer_count: int = 5,
        params_buffer_size: int = 100_000_000,
        max_in_cpu: int = 1_000_000_000,
        offload_optimizer_device: str = "cpu",
        optimizer_buffer_count: int = 4,
        block_size: int = 1048576,
        queue_depth: int = 8,
        single_submit: bool = False,
        overlap_events: bool = True,
        thread_count: int = 1,
        pin_memory: bool = False,
        sub_group_size: int = 1_000_000_000_000,
        contiguous_gradients: bool = True,
        overlap_comm: bool = True,
        allgather_partitions: bool = True,
        reduce_scatter: bool = True,
        allgather_bucket_size: int = 200_000_000,
        reduce_bucket_size: int = 200_000_000,
        zero_allow_untested_optimizer: bool = True,
        logging_batch_size_per_gpu: str | int = "auto",
        config: _PATH | dict[str, Any] | None = None,
        logging_level: int = logging.WARN,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        loss_scale: float = 0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        min_loss_scale: int = 1,
        partition_activations: bool = False,
        cpu_checkpointing: bool = False,
        contiguous_memory_optimization: bool = False,
        synchronize_checkpoint_boundary: bool = False,
        load_full_weights: bool = False,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        exclude_frozen_parameters: bool = False,
    ) -> None:
        """``DeepSpeedStrategy``'s arguments (Lightning's documentation describes each).

        ``config`` (a ds_config dict or JSON path, or ``PL_DEEPSPEED_CONFIG_PATH``) replaces the config the
        other arguments build, as in Lightning.

        Raises:
            ValueError: an argument of ``NO_EFFECT`` given a value other than its default, or ``stage`` not
                0-3.
        """
        given = locals()
        changed = {name: given[name] for name, default in NO_EFFECT.items() if given[name] != default}
        if changed:
            listed = ", ".join(f"{k}={v!r} (default {NO_EFFECT[k]!r})" for k, v in changed.items())
            raise ValueError(f"ZeroshardStrategy: these arguments have no effect in zeroshard: {listed}")
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeroshardStrategy(stage={stage!r}): stage must be 0, 1, 2 or 3")
        # DeepSpeedStrategy.__init__ would refuse to run without a `deepspeed` distribution: set up the
        # DDPStrategy base it builds on, then the attributes it sets, ourselves.
        DDPStrategy.__init__(
            self,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
        )
        self._timeout: timedelta | None = timeout
        self.config = self._load_config(config)
        if self.config is None:
            self.config = self._create_default_config(
                zero_optimization,
                zero_allow_untested_optimizer,
                logging_batch_size_per_gpu,
                offload_optimizer=offload_optimizer,
                offload_parameters=offload_parameters,
                nvme_path=nvme_path,
                offload_params_device=offload_params_device,
                params_buffer_count=params_buffer_count,
                params_buffer_size=params_buffer_size,
                max_in_cpu=max_in_cpu,
                pin_memory=pin_memory,
                offload_optimizer_device=offload_optimizer_device,
                optimizer_buffer_count=optimizer_buffer_count,
                block_size=block_size,
                queue_depth=queue_depth,
                single_submit=single_submit,
                overlap_events=overlap_events,
                thread_count=thread_count,
                partition_activations=partition_activations,
                cpu_checkpointing=cpu_checkpointing,
                contiguous_memory_optimization=contiguous_memory_optimization,
                synchronize_checkpoint_boundary=synchronize_checkpoint_boundary,
                stage=stage,
                contiguous_gradients=contiguous_gradients,
                overlap_comm=overlap_comm,
                allgather_partitions=allgather_partitions,
                reduce_scatter=reduce_scatter,
                allgather_bucket_size=allgather_bucket_size,
                reduce_bucket_size=reduce_bucket_size,
                sub_group_size=sub_group_size,
            )
        self._config_initialized = False
        zs_deepspeed.utils.logger.setLevel(logging_level)
        self.remote_device = remote_device
        self.load_full_weights = load_full_weights
        self.exclude_frozen_parameters = exclude_frozen_parameters
        self.loss_scale = loss_scale
        self.initial_scale_power = initial_scale_power
        self.loss_scale_window = loss_scale_window
        self.hysteresis = hysteresis
        self.min_loss_scale = min_loss_scale

    def _create_default_config(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's default config, less the blocks that would configure nothing here: ``aio`` unless
        something goes to NVMe (then with ``thread_count`` under its current name ``intra_op_parallelism``),
        and ``activation_checkpointing`` (every switch in it is in ``NO_EFFECT``)."""
        cfg = super()._create_default_config(*args, **kwargs)
        cfg.pop("activation_checkpointing", None)
        aio = cfg.pop("aio")
        zero = cfg.get("zero_optimization", {})
        blocks = (zero.get("offload_optimizer", {}), zero.get("offload_param", {}))
        if any(block.get("device") == "nvme" for block in blocks):
            aio["intra_op_parallelism"] = aio.pop("thread_count")
            for name in ("single_submit", "overlap_events"):
                aio.pop(name)
            cfg["aio"] = aio
        return cfg

    # -- CPU as well as CUDA ---------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Lightning allows its DeepSpeed strategy on CUDA only; zeroshard also trains on CPU (gloo)."""
        if not isinstance(self.accelerator, (CUDAAccelerator, CPUAccelerator)):
            raise RuntimeError(
                f"ZeroshardStrategy runs on the 'cuda' and 'cpu' accelerators, not on "
                f"{type(self.accelerator).__name__}"
            )
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        assert self.parallel_devices is not None
        if self.root_device.type == "cuda":
            _validate_device_index_selection(self.parallel_devices)
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    # -- where DeepSpeedStrategy imports deepspeed ------------------------------------------------------
    def _init_deepspeed_distributed(self) -> None:
        """Join the process group through ``zeroshard.deepspeed.init_distributed``. Collective."""
        assert self.cluster_environment is not None
        if platform.system() != "Windows":
            self._set_node_environment_variables()
        self._process_group_backend = self._get_process_group_backend()
        zs_deepspeed.init_distributed(
            self._process_group_backend,
            distributed_port=self.cluster_environment.main_port,
            timeout=DEFAULT_TIMEOUT if self._timeout is None else self._timeout,
        )

    def _setup_model_and_optimizer(
        self,
        model: Module,
        optimizer: Optimizer | None,
        lr_scheduler: Any = None,
    ) -> tuple[zs_deepspeed.DeepSpeedEngine, Optimizer]:
        """The engine over ``model`` from ``zeroshard.deepspeed.initialize``. Collective."""
        engine, engine_optimizer, _, _ = zs_deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.root_device.index),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, engine_optimizer  # type: ignore[return-value]

    def _initialize_deepspeed_inference(self, model: Module) -> None:
        """An engine without optimizer for validate / test / predict, as Lightning's (same config subset)."""
        assert isinstance(self.config, dict)
        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                config[key] = self.config[key]
        if self.zero_stage_3:
            config["zero_optimization"] = self.config["zero_optimization"]
        remove_module_hooks(model)
        engine, _, _, _ = zs_deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.root_device.index),
            config=config,
            model=model,
            model_parameters=[],
            dist_init_required=False,
        )
        self.model = engine

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` runs here: under ``zeroshard.deepspeed.zero.Init`` at stage 3."""
        self._init_config_if_needed()
        with zs_deepspeed.zero.Init(
            enabled=self.zero_stage_3, remote_device=self.remote_device, config_dict_or_path=self.config
        ):
            yield

    def _set_deepspeed_activation_checkpointing(self) -> None:
        assert isinstance(self.config, dict)
        block = self.config.get("activation_checkpointing")
        if block:
            zs_deepspeed.checkpointing.configure(
                mpu_=None,
                partition_activations=block.get("partition_activations"),
                contiguous_checkpointing=block.get("contiguous_memory_optimization"),
                checkpoint_in_cpu=block.get("cpu_checkpointing"),
                profile=block.get("profile"),
            )

    def _restore_zero_state(self, ckpt: Mapping[str, Any], strict: bool) -> None:
        """``load_full_weights=True`` at stage 3: every rank loads the consolidated ``state_dict``.

        The engine's state-dict hooks gather each unit for the load and write the values into the master
        shards (see ``zeroshard.runtime.state_dict_hooks.install_state_dict_hooks``). Collective.
        """
        assert self.lightning_module is not None
        self.lightning_module.load_state_dict(ckpt["state_dict"], strict=strict)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``STRATEGY_NAMES`` (names already taken by this class are left as they are)."""
        for name, (description, init_params) in STRATEGY_NAMES.items():
            if name not in strategy_registry or strategy_registry[name]["strategy"] is not cls:
                strategy_registry.register(name, cls, description=description, override=True, **init_params)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: _PATH, output_file: _PATH, tag: str | None = None
) -> dict[str, Any]:
    """One Lightning checkpoint file from the sharded checkpoint directory Lightning saved with zeroshard.

    Lightning's function of the same name (``lightning.pytorch.utilities.deepspeed``) reads DeepSpeed's file
    layout; this one reads zeroshard's, written by ``ZeroshardStrategy`` or by Lightning's ``deepspeed_*``
    strategies under the alias. ``checkpoint_dir`` is what ``trainer.save_checkpoint`` / ``ModelCheckpoint``
    wrote (e.g. ``epoch=2.ckpt/``, holding ``latest`` and the tag ``checkpoint``). The file holds the fp32
    ``state_dict`` (from the master weights) and Lightning's other entries (epoch, loops, callbacks,
    hyper-parameters), but no optimizer state: it loads with ``LightningModule.load_from_checkpoint``,
    any strategy's ``ckpt_path=`` for validate / test / predict, or ``ZeroshardStrategy(stage=3,
    load_full_weights=True)``. No process group is needed. Returns what it wrote.
    """
    with open_checkpoint(checkpoint_dir, tag) as reader:
        client_state = reader.decode(reader.meta.get("client_state", {}))
    checkpoint = {**client_state, "state_dict": get_fp32_state_dict(checkpoint_dir, tag)}
    torch.save(checkpoint, output_file)
    return checkpoint


ZeroshardStrategy.register_strategies(StrategyRegistry)
