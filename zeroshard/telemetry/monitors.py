"""The config's monitors: TensorBoard, CSV and Weights & Biases, writing DeepSpeed's event names.

An event is DeepSpeed's tuple `(name, value, x)` with x = global samples. Each monitor writes where
DeepSpeed's does: TensorBoard and CSV under `os.path.join(output_path, job_name)` (empty `output_path`:
relative to the working directory), one CSV file per event named after it (`Train_Samples_lr.csv`, header
`step,lr`), W&B into `project` / `group` / `team` with `step=x`. Only rank 0 builds monitors.
"""

from __future__ import annotations

import csv
import importlib.util
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from zeroshard.config import ZeroshardConfig

__all__ = [
    "CSVMonitor",
    "Event",
    "Monitor",
    "MonitorMaster",
    "TensorBoardMonitor",
    "WandbMonitor",
    "as_events",
    "build_monitors",
    "check_available",
    "monitors_enabled",
    "require_package",
]

Event = tuple[str, float, int]
"""(name, value, global_samples), DeepSpeed's summary event."""


class Monitor(Protocol):
    def write_events(self, events: list[Event]) -> None: ...

    def close(self) -> None: ...


class TensorBoardMonitor:
    """Scalars in a TensorBoard event file under `log_dir`, flushed after every write (as DeepSpeed does)."""

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir)

    def write_events(self, events: list[Event], flush: bool = True) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        if flush:
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class CSVMonitor:
    """One CSV file per event under `log_dir`, DeepSpeed's csv_monitor layout."""

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir

    def path(self, name: str) -> Path:
        """The file that event `name` is written to."""
        return Path(self.log_dir) / (name.replace("/", "_").replace(" ", "_") + ".csv")

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            path = self.path(name)
            with path.open("a", newline="", encoding="utf-8") as file:
                writer = csv.writer(file)
                # A resumed run appends to the file; the header goes only at its top, so it stays one table.
                if file.tell() == 0:
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        pass  # every write opens and closes its file


class WandbMonitor:
    """A Weights & Biases run; `WANDB_MODE=offline` keeps it local."""

    def __init__(self, project: str, group: str | None, team: str | None, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project=project, group=group, entity=team, config=config)

    def write_events(self, events: list[Event]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for name, value, step in events:
            by_step.setdefault(step, {})[name] = value
        for step, values in sorted(by_step.items()):
            self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MonitorMaster:
    """DeepSpeed's ``engine.monitor``: the config's monitors behind one ``write_events``.

    ``enabled`` says whether the config enables a monitor, the same on every rank. Only rank 0 holds
    monitors, so ``write_events`` writes there and does nothing on the other ranks, as DeepSpeed's does. An
    event is ``(name, value, x)``; ``value`` may be a number or a one-element tensor.
    """

    def __init__(self, monitors: Sequence[Monitor], enabled: bool) -> None:
        self.monitors = list(monitors)
        self.enabled = enabled

    def write_events(self, event_list: Iterable[tuple[str, Any, int]]) -> None:
        events = as_events(event_list)
        for monitor in self.monitors:
            monitor.write_events(events)


def as_events(event_list: Iterable[tuple[str, Any, int]]) -> list[Event]:
    """A script's ``(name, value, x)`` tuples as events: the value a float (a number or a one-element
    tensor), ``x`` an int."""
    return [(str(name), float(value), int(x)) for name, value, x in event_list]


_EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def check_available(config: ZeroshardConfig) -> None:
    """Checks that every enabled monitor's package is installed; call it on every rank.

    Every rank checks (not only rank 0, which writes) so that a missing package stops all of them at once
    instead of leaving the others waiting in a collective.

    Raises:
        ImportError: Naming the config key that enabled the monitor and the pip command that installs it.
    """
    for key in _EXTRAS:
        if getattr(config, key).enabled:
            require_package(key, f"{key}.enabled is true in the config but ")


def require_package(key: str, context: str = "") -> None:
    """``ImportError`` naming the pip command when the package of the ``key`` monitor ("tensorboard",
    "wandb") is not installed; ``context`` opens the message."""
    module, extra = _EXTRAS[key]
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"{context}the {module} package is not installed: pip install 'zeroshard[{extra}]' (or pip "
            f"install {module}), or set {key}.enabled to false"
        )


def monitors_enabled(config: ZeroshardConfig) -> bool:
    """Whether the config enables any monitor (the same answer on every rank, unlike `build_monitors`)."""
    return config.tensorboard.enabled or config.csv_monitor.enabled or config.wandb.enabled


def build_monitors(config: ZeroshardConfig) -> list[Monitor]:
    """The monitors the config enables (call on rank 0 only)."""
    check_available(config)
    monitors: list[Monitor] = []
    if config.tensorboard.enabled:
        monitors.append(
            TensorBoardMonitor(os.path.join(config.tensorboard.output_path, config.tensorboard.job_name))
        )
    if config.csv_monitor.enabled:
        monitors.append(CSVMonitor(os.path.join(config.csv_monitor.output_path, config.csv_monitor.job_name)))
    if config.wandb.enabled:
        wandb = config.wandb
        monitors.append(WandbMonitor(wandb.project, wandb.group, wandb.team, config.to_dict()))
    return monitors
