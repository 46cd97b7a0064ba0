"""`rlsearch plot`: the PNG of a run's curves, with a panel for each curve family the run logged."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from rlsearch.cli import main
from rlsearch.runlog import RunLogger, plot_run, read_scalars

GRPO_PANELS = ["reward", "exact match", "turns", "tool calls", "response length", "KL", "clip fraction",
               "logprob mismatch", "grad norm", "learning rate"]


def _log_grpo_run(run_dir: Path, steps: int) -> None:
    logger = RunLogger(run_dir, log_trajectories=False)
    for step in range(1, steps + 1):
        logger.log_metrics(step, {
            "reward/mean": 0.1 * step, "reward/em": 0.05 * step, "rollout/turns_mean": 2.0,
            "rollout/tool_calls_mean": 1.0, "rollout/invalid_calls_mean": 0.1, "rollout/response_len_mean": 80.0,
            "rollout/model_tokens_mean": 20.0, "actor/approx_kl": 1e-3, "actor/kl_loss": 0.0,
            "actor/clip_fraction": 0.01, "weights/logprob_mismatch_max": 3e-6, "actor/grad_norm": 0.5,
            "actor/lr": 1e-5, "time/step_s": 10.0,
        })
    logger.log_metrics(steps, {"eval/overall/em": 0.4})
    logger.close()


def test_plot_writes_the_panels_of_a_grpo_run(tmp_path: Path) -> None:
    _log_grpo_run(tmp_path, steps=3)
    path = plot_run(tmp_path)
    assert path == tmp_path / "tensorboard" / "curves.png"
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width > 1000 and image.height > 400
        assert image.text["Panels"].split(", ") == GRPO_PANELS
    assert read_scalars(tmp_path / "tensorboard")["reward/em"] == [(1, pytest.approx(0.05)), (2, pytest.approx(0.1)),
                                                                  (3, pytest.approx(0.15))]


def test_plot_of_an_sft_run_and_the_cli(tmp_path: Path, capsys) -> None:
    logger = RunLogger(tmp_path, log_trajectories=False)
    for step in range(1, 5):
        logger.log_metrics(step, {"sft/loss": 5.0 / step, "actor/grad_norm": 1.0, "actor/lr": 1e-3})
    logger.close()
    assert main(["plot", str(tmp_path)]) == 0
    assert "curves written to" in capsys.readouterr().out
    with Image.open(tmp_path / "tensorboard" / "curves.png") as image:
        assert image.text["Panels"] == "SFT loss, grad norm, learning rate"


def test_plot_errors(tmp_path: Path, capsys) -> None:
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "has no tensorboard/ dir" in capsys.readouterr().err
    RunLogger(tmp_path, log_trajectories=False).close()
    assert plot_run(tmp_path) is None
    assert main(["plot", str(tmp_path)]) == 2
    assert "holds no scalars yet" in capsys.readouterr().err
