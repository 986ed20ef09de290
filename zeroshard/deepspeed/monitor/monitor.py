"""``deepspeed.monitor.monitor``: DeepSpeed's monitor classes, each built from its config block.

They write through zeroshard's writers (``zeroshard.telemetry.monitors``), to the same places DeepSpeed's
do: TensorBoard and CSV under ``os.path.join(output_path, job_name)``, W&B into ``project`` / ``group`` /
``team``. As in DeepSpeed, only rank 0 opens writers and writes; on the other ranks ``write_events`` does
nothing. An engine's own monitors are ``engine.monitor`` (``zeroshard.telemetry.monitors.MonitorMaster``):
building these classes for a config the engine also monitors opens a second writer on the same files.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.monitor.utils import check_tb_availability, check_wandb_availability
from zeroshard.deepspeed.refusals import refuse
from zeroshard.telemetry import monitors as writers

__all__ = ["Monitor", "MonitorMaster", "TensorBoardMonitor", "WandbMonitor", "csvMonitor"]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Monitor:
    """The base of DeepSpeed's monitors: ``monitor_config`` and ``write_events(event_list)``."""

    def __init__(self, monitor_config: Any) -> None:
        self.monitor_config = monitor_config

    def write_events(self, event_list: Iterable[tuple[str, Any, int]]) -> None:
        raise NotImplementedError(f"{type(self).__name__}.write_events")


class TensorBoardMonitor(Monitor):
    """Scalars in a TensorBoard event file (the ``tensorboard`` block); ``summary_writer`` on rank 0."""

    def __init__(self, tensorboard_config: Any) -> None:
        super().__init__(tensorboard_config)
        check_tb_availability()
        self.enabled: bool = tensorboard_config.enabled
        self.output_path: str = tensorboard_config.output_path
        self.job_name: str = tensorboard_config.job_name
        self.summary_writer: Any = None
        self._writer: writers.TensorBoardMonitor | None = None
        self.get_summary_writer()

    def get_summary_writer(self, base: str = "") -> Any:
        """Open (once, on rank 0, when enabled) and return the ``SummaryWriter``."""
        if self.enabled and _rank() == 0 and self._writer is None:
            self._writer = writers.TensorBoardMonitor(os.path.join(self.output_path, self.job_name))
            self.summary_writer = self._writer.writer
        return self.summary_writer

    def write_events(self, event_list: Iterable[tuple[str, Any, int]], flush: bool = True) -> None:
        if self._writer is not None:
            self._writer.write_events(writers.as_events(event_list), flush=flush)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.writer.flush()


class csvMonitor(Monitor):
    """One CSV file per event name (the ``csv_monitor`` block): ``log_dir`` on rank 0, else None."""

    def __init__(self, csv_config: Any) -> None:
        super().__init__(csv_config)
        self.filenames: list[str] = []
        self.enabled: bool = csv_config.enabled
        self.output_path: str = csv_config.output_path
        self.job_name: str = csv_config.job_name
        self._writer: writers.CSVMonitor | None = None
        self.log_dir = self.setup_log_dir()

    def setup_log_dir(self, base: str = "") -> str | None:
        """Create the directory (on rank 0, when enabled) and return it."""
        if not (self.enabled and _rank() == 0):
            return None
        self._writer = writers.CSVMonitor(os.path.join(self.output_path, self.job_name))
        return self._writer.log_dir

    def write_events(self, event_list: Iterable[tuple[str, Any, int]]) -> None:
        if self._writer is not None:
            events = writers.as_events(event_list)
            self._writer.write_events(events)
            for stem in (self._writer.path(name).stem for name, _, _ in events):
                if stem not in self.filenames:
                    self.filenames.append(stem)


class WandbMonitor(Monitor):
    """A Weights & Biases run (the ``wandb`` block), started on rank 0 when enabled."""

    def __init__(self, wandb_config: Any) -> None:
        super().__init__(wandb_config)
        check_wandb_availability()
        self.enabled: bool = wandb_config.enabled
        self.group: str | None = wandb_config.group
        self.team: str | None = wandb_config.team
        self.project: str = wandb_config.project
        self._writer: writers.WandbMonitor | None = None
        if self.enabled and _rank() == 0:
            self._writer = writers.WandbMonitor(self.project, self.group, self.team, {})

    def log(self, data: dict[str, Any], step: int | None = None, commit: bool | None = None) -> None:
        """``wandb.log`` on rank 0 (when enabled)."""
        if self._writer is not None:
            self._writer.run.log(data, step=step, commit=commit)

    def write_events(self, event_list: Iterable[tuple[str, Any, int]]) -> None:
        if self._writer is not None:
            self._writer.write_events(writers.as_events(event_list))


class MonitorMaster(writers.MonitorMaster):
    """The monitors a ``DeepSpeedMonitorConfig`` enables, behind one ``write_events``; rank 0 writes."""

    def __init__(self, monitor_config: Any) -> None:
        self.monitor_config = monitor_config
        self.tb_monitor: TensorBoardMonitor | None = None
        self.wandb_monitor: WandbMonitor | None = None
        self.csv_monitor: csvMonitor | None = None
        self.comet_monitor: Any = None
        if _rank() == 0:
            if monitor_config.tensorboard.enabled:
                self.tb_monitor = TensorBoardMonitor(monitor_config.tensorboard)
            if monitor_config.wandb.enabled:
                self.wandb_monitor = WandbMonitor(monitor_config.wandb)
            if monitor_config.csv_monitor.enabled:
                self.csv_monitor = csvMonitor(monitor_config.csv_monitor)
            if monitor_config.comet.enabled:
                refuse("deepspeed.monitor.comet.CometMonitor", "the Comet monitor")
        opened = [m for m in (self.tb_monitor, self.wandb_monitor, self.csv_monitor) if m is not None]
        super().__init__(opened, monitor_config.enabled)  # type: ignore[arg-type]


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
