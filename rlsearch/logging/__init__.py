"""Run outputs a person reads: TensorBoard scalars, trajectory JSONL, a progress line per step, PNG curves."""

from .plot import CURVES_FILE, plot_run, read_scalars
from .writer import RunLogger, format_step_line

__all__ = ["CURVES_FILE", "RunLogger", "format_step_line", "plot_run", "read_scalars"]
