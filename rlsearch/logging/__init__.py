"""Run outputs a person reads: TensorBoard scalars, trajectory JSONL, a progress line per step."""

from .writer import RunLogger, format_step_line

__all__ = ["RunLogger", "format_step_line"]
