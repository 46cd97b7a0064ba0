"""Run outputs a person reads: TensorBoard scalars, trajectory JSONL, a progress line per step, the summary at the
end, PNG curves, and where the libraries' own logs go (a file per process under the run's logs/ dir unless
verbose)."""

from .failures import ProcessFailure, process_failure, ray_death
from .plot import CURVES_FILE, plot_run, read_scalars
from .process_logs import in_ray_actor, process_log_dir, redirect_worker_output, route_library_logs
from .summary import RunSummary
from .writer import TRAJECTORY_DIR, RunLogger, format_step_line

__all__ = [
    "CURVES_FILE", "TRAJECTORY_DIR", "ProcessFailure", "RunLogger", "RunSummary", "format_step_line", "in_ray_actor",
    "plot_run", "process_failure", "process_log_dir", "ray_death", "read_scalars", "redirect_worker_output",
    "route_library_logs",
]
