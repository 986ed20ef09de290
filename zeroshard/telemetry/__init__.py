"""Training telemetry: timers, `steps_per_print` log lines and the TensorBoard / CSV / W&B monitors.

See `telemetry.py` for how the engine drives it and [Note: telemetry events] there for what is written,
and `log.py` for the log line and where it goes when the script configured no logging.
"""

from __future__ import annotations

from zeroshard.telemetry.record import StepRecord
from zeroshard.telemetry.telemetry import Telemetry

__all__ = ["StepRecord", "Telemetry"]
