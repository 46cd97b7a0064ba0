"""How the tests run training drivers as a user does: a command from the repository's root, and the tiny config's
`rlsearch train` over the session's model and toy data."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.constants import REPO_ROOT, SHORT_TURNS


class Started(Exception):
    """Something of a run started (Ray, a tool server, the supervisor's driver): a start-up check did not stop it
    first (the `nothing_may_start` fixture raises it)."""


def run_from_repo(args, timeout, warm_start="none", **env):
    """`args` run from the repository root; `env` on top of this process's (the `driver_ray` fixture's environment: a
    driver that joins the session's Ray and takes over the engines of the run before it)."""
    env = {**os.environ, "RLSEARCH_WARM_START": warm_start, **env}
    return subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def run_search_grpo(out, *overrides, timeout, model: str = "", **env):
    """`bash examples/run_search_grpo.sh` by `run_from_repo`: `overrides`, then short turns, the tests' model (or the
    `model` override, e.g. another `tests.models.model_override`) and trainer.output_dir=`out`."""
    from tests.models import model_override

    args = ["bash", "examples/run_search_grpo.sh", *overrides, SHORT_TURNS, model or model_override(),
            f"trainer.output_dir={out}"]
    return run_from_repo(args, timeout, **env)


def train_command(tiny_model_dir, toy_data, index_cache, output_dir, *extra):
    """`rlsearch train` of the tiny config: 2 steps of 2 questions, a checkpoint after each, short turns; `extra`
    overrides on top."""
    return [
        sys.executable, "-m", "rlsearch", "train", "--config", "examples/configs/search_grpo_tiny.yaml",
        f"model.path={tiny_model_dir}", f"data.train_files=[{toy_data.train}]",
        f"tools.retriever.corpus={toy_data.corpus}", f"tools.retriever.index_cache_dir={index_cache}",
        "data.batch_size=2", "trainer.total_steps=2", "trainer.save_interval=1", SHORT_TURNS,
        f"trainer.output_dir={output_dir}", *extra,
    ]
