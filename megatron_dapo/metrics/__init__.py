"""What a run reports: TensorBoard scalars and samples (writer.py), alarms (alarms.py), phase timers and the
progress bar (timer.py), and reading event files back (events.py)."""

from megatron_dapo.metrics.alarms import Alarms
from megatron_dapo.metrics.events import read_scalars, read_texts
from megatron_dapo.metrics.timer import PhaseTimer, progress
from megatron_dapo.metrics.writer import PANELS, PLOTTED, SUMMARY_CURVES, MetricsWriter

__all__ = ["PANELS", "PLOTTED",
           "SUMMARY_CURVES", "Alarms", "MetricsWriter", "PhaseTimer", "progress", "read_scalars", "read_texts"]
