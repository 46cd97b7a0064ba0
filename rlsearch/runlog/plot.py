"""Curves a person can look at: one PNG of panels drawn from a run's TensorBoard scalars, written next to them.

Each panel plots the scalars it names that the run logged (a GRPO run: reward, EM, turns, tool calls, response
length, KL, clip fraction, engine-vs-actor logprob mismatch; an SFT run: loss, grad norm, learning rate); panels
with nothing logged are left out. The PNG's "Panels" text chunk lists the drawn panels' titles.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CURVES_FILE = "curves.png"


@dataclass(frozen=True)
class Panel:
    title: str
    tags: tuple[str, ...]  # TensorBoard scalar tags drawn in it (the first one found gives the y label)


PANELS = (
    Panel("reward", ("reward/mean",)),
    Panel("exact match", ("reward/em", "eval/overall/em")),
    Panel("turns", ("rollout/turns_mean",)),
    Panel("tool calls", ("rollout/tool_calls_mean", "rollout/invalid_calls_mean")),
    Panel("response length", ("rollout/response_len_mean", "rollout/model_tokens_mean")),
    Panel("KL", ("actor/approx_kl", "actor/kl_loss")),
    Panel("clip fraction", ("actor/clip_fraction",)),
    Panel("logprob mismatch", ("weights/logprob_mismatch_max", "rollout/actor_logprob_diff_mean")),
    Panel("SFT loss", ("sft/loss",)),
    Panel("grad norm", ("actor/grad_norm",)),
    Panel("learning rate", ("actor/lr",)),
)
_COLUMNS = 4


def read_scalars(tensorboard_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the event files under `tensorboard_dir` as (step, value) pairs in step order (a step
    logged twice, by a run and its resume, keeps the last value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    scalars = {}
    for tag in accumulator.Tags()["scalars"]:
        by_step = {event.step: event.value for event in accumulator.Scalars(tag)}
        scalars[tag] = sorted(by_step.items())
    return scalars


def plot_run(run_dir: str | Path) -> Path | None:
    """Draw `run_dir`/tensorboard into `run_dir`/tensorboard/curves.png; None when nothing was logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tensorboard_dir = Path(run_dir) / "tensorboard"
    if not tensorboard_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} has no tensorboard/ dir: give a run's output_dir")
    scalars = read_scalars(tensorboard_dir)
    drawn = [(panel, [tag for tag in panel.tags if scalars.get(tag)]) for panel in PANELS]
    drawn = [(panel, tags) for panel, tags in drawn if tags]
    if not drawn:
        return None
    rows = -(-len(drawn) // _COLUMNS)
    columns = min(_COLUMNS, len(drawn))
    figure, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3 * rows), squeeze=False)
    for axis, (panel, tags) in zip(axes.flat, drawn):
        for tag in tags:
            steps, values = zip(*scalars[tag])
            axis.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=tag)
        axis.set_title(panel.title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    for axis in list(axes.flat)[len(drawn):]:
        axis.set_visible(False)
    figure.suptitle(str(Path(run_dir).resolve().name))
    figure.tight_layout()
    out = tensorboard_dir / CURVES_FILE
    figure.savefig(out, dpi=80, metadata={"Panels": ", ".join(panel.title for panel, _ in drawn)})
    plt.close(figure)
    return out
