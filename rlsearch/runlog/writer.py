"""TensorBoard scalars + per-step trajectory JSONL under one run directory, and the same scalars, the run's config and
each step's sample table in Weights & Biases where asked (``trainer.loggers: [tensorboard, wandb]``)."""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

_STEP_LINE_KEYS = (
    ("reward", "reward/mean", "{:.3f}"),
    ("EM", "reward/em", "{:.3f}"),
    ("turns", "rollout/turns_mean", "{:.2f}"),
    ("calls", "rollout/tool_calls_mean", "{:.2f}"),
    ("invalid", "rollout/invalid_calls_mean", "{:.2f}"),
    ("len", "rollout/response_len_mean", "{:.0f}"),
    ("loss", "actor/policy_loss", "{:+.4f}"),
    # with a critic (algo.advantage=gae): its value loss and how much of the returns' variance its values explained
    ("value loss", "critic/value_loss", "{:.4f}"),
    ("EV", "critic/explained_variance", "{:+.2f}"),
    ("mismatch", "weights/logprob_mismatch_max", "{:.1e}"),
    ("time", "time/step_s", "{:.1f}s"),
)


def format_step_line(step: int, total_steps: int, metrics: Mapping[str, float]) -> str:
    parts = [f"step {step}/{total_steps}"]
    for label, key, fmt in _STEP_LINE_KEYS:
        if key in metrics:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    return " | ".join(parts)


SAMPLE_COLUMNS = ("example_id", "sample_index", "question", "golden_answers", "response", "reward", "finish_reason",
                  "num_turns")
WANDB_DIR = "wandb"
WANDB_RUN_ID_FILE = "rlsearch-run-id"  # under output_dir/wandb: a resumed run logs into the same wandb run


class WandbRun:
    """The wandb side of a run: its config at the start, the scalars of every step, a table of each step's samples.
    Under output_dir/wandb; WANDB_MODE=offline writes it all there with nothing to reach (`wandb sync` uploads it).
    A resumed run continues the same wandb run (its id is kept beside it); wandb keeps no step twice, so the steps a
    rewind trains again keep their first values there (TensorBoard shows the new ones)."""

    def __init__(self, output_dir: Path, config: Mapping | None, project: str, name: str) -> None:
        try:
            import wandb
        except ImportError as error:
            raise RuntimeError("trainer.loggers names wandb, which is not installed: pip install wandb (it is in "
                               "requirements/*.txt), or drop it from trainer.loggers") from error

        directory = output_dir / WANDB_DIR
        directory.mkdir(parents=True, exist_ok=True)
        id_file = directory / WANDB_RUN_ID_FILE
        if not id_file.is_file():
            id_file.write_text(secrets.token_hex(4))  # a wandb run id: lowercase letters and digits
        self._wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or project, name=name or output_dir.resolve().name,
            dir=str(output_dir), id=id_file.read_text().strip(), resume="allow", config=dict(config or {}),
            # rlsearch's own lines stay as they are: wandb neither captures the terminal nor prints its banner
            settings=wandb.Settings(console="off", silent=True),
        )

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_samples(self, step: int, records: Sequence[dict]) -> None:
        table = self._wandb.Table(columns=list(SAMPLE_COLUMNS))
        for record in records:
            table.add_data(*_sample_row(record))
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


def _sample_row(record: dict) -> list:
    """A trajectory record's row of the sample table: what was asked, what the policy wrote and saw, its reward."""
    response = "".join(turn.get("text", "") + (turn.get("observation") or "") for turn in record.get("turns", []))
    golden = record.get("golden_answers") or []
    row = {**record, "response": response, "golden_answers": "; ".join(map(str, golden))}
    return [row.get(column) for column in SAMPLE_COLUMNS]


# the longest a logger waits for the second after an event file's: a file stamped further ahead comes from a clock
# that stepped back or from another host's, and waiting for it would block start-up for as long as the skew
EVENT_FILE_WAIT_LIMIT_S = 2.0


def _wait_for_a_second_after_the_event_files_in(tensorboard_dir: Path) -> None:
    """TensorBoard reads a dir's event files in name order, and a name starts with the second its writer opened in
    (then host, pid and a per-process counter, which sort as text: 10 before 9). A writer opened in the second of an
    earlier one could be read first, and the earlier file's purge (`resumed_step`) would then drop the later scalars.
    A file stamped more than EVENT_FILE_WAIT_LIMIT_S ahead is not waited for: one line says so."""
    stamped = {int(name.split(".")[3]): name for name in os.listdir(tensorboard_dir)
               if name.startswith("events.out.tfevents.") and name.split(".")[3].isdigit()}
    if not stamped:
        return
    newest = max(stamped)
    ahead_s = newest + 1 - time.time()
    if ahead_s > EVENT_FILE_WAIT_LIMIT_S:
        print(f"[rlsearch] {tensorboard_dir} holds an event file stamped {ahead_s:.0f} s in the future "
              f"({stamped[newest]}: clock skew, or a run dir copied from another host); TensorBoard reads it after "
              "this run's scalars, so its steps may show again: move it out of the dir to see only this run's",
              flush=True)
        return
    while int(time.time()) <= newest:
        time.sleep(0.02)


TRAJECTORY_DIR = "trajectories"  # a run's step_N.jsonl files, under its output dir


class RunLogger:
    def __init__(
        self, output_dir: str | Path, log_trajectories: bool = True, resumed_step: int | None = None,
        loggers: Sequence[str] = ("tensorboard",), config: Mapping | None = None, wandb_project: str = "rlsearch",
        wandb_run_name: str = "",
    ) -> None:
        """`resumed_step`: the step a training run continues after: a resume's checkpoint step, a rewind's, 0 for a
        run that starts at step 1 (a fresh one, or one rewound to the start). TensorBoard then drops what an earlier
        run logged for later steps (a step that was logged but not checkpointed is trained again), so each step shows
        once. None: nothing is dropped (an eval adding its scalars to a run's log). `loggers` with wandb: also a
        `WandbRun` of `config` (trainer.wandb_project, trainer.wandb_run_name)."""
        from torch.utils.tensorboard import SummaryWriter

        self.output_dir = Path(output_dir)
        self.tensorboard_dir = self.output_dir / "tensorboard"
        self.trajectory_dir = self.output_dir / TRAJECTORY_DIR
        self.write_trajectories = log_trajectories
        self.tensorboard_dir.mkdir(parents=True, exist_ok=True)
        if self.write_trajectories:
            self.trajectory_dir.mkdir(parents=True, exist_ok=True)
        purge_step = None if resumed_step is None else resumed_step + 1
        _wait_for_a_second_after_the_event_files_in(self.tensorboard_dir)
        self.writer = SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=purge_step)
        self.wandb = WandbRun(self.output_dir, config, wandb_project, wandb_run_name) if "wandb" in loggers else None

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        scalars = {key: value for key, value in metrics.items()
                   if isinstance(value, (int, float)) and math.isfinite(value)}
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()
        if self.wandb is not None:
            self.wandb.log_metrics(step, scalars)

    def log_histogram(self, step: int, key: str, values: Sequence[float]) -> None:
        """A TensorBoard histogram (nothing for no values)."""
        if values:
            self.writer.add_histogram(key, np.asarray(values, dtype=np.float64), global_step=step)

    def log_trajectories(self, step: int, records: Iterable[dict]) -> Path | None:
        """The step's trajectory JSONL (trainer.log_trajectories) and its wandb sample table (trainer.loggers)."""
        records = list(records)
        if self.wandb is not None:
            self.wandb.log_samples(step, records)
        if not self.write_trajectories:
            return None
        path = self.trajectory_dir / f"step_{step:06d}.jsonl"
        with path.open("w") as handle:
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        return path

    def close(self) -> None:
        self.writer.close()
        if self.wandb is not None:
            self.wandb.close()
