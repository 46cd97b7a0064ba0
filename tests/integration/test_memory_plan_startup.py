"""The memory check at the start of `rlsearch train`: a run whose plan does not fit the memory given stops with exit
code 2 and what would fit, before Ray, the tool servers or any actor start; trainer.memory_check=warn runs past it;
`rlsearch plan` prints the plan and proposes layouts."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rlsearch.cli import main
from rlsearch.config import load_train_config
from rlsearch.memory import GB, QUIET_BELOW, Device, plan_memory, plan_train_config, train_memory_inputs
from tests.conftest import REPO_ROOT

EXAMPLE = str(REPO_ROOT / "examples" / "configs" / "search_grpo_tiny.yaml")
LONG = 131_072  # a context window whose activations do not fit the memory the tests give


class Started(Exception):
    """Something of the run started: the check did not stop it first."""


@pytest.fixture
def nothing_may_start(monkeypatch):
    """Ray, the tool servers and the supervisor's driver raise Started if anything calls them."""
    import rlsearch.supervisor
    import rlsearch.trainer.grpo

    def started(*_args, **_kwargs):
        raise Started

    for module, name in ((rlsearch.trainer.grpo, "init_ray"), (rlsearch.trainer.grpo, "start_tool_servers"),
                         (rlsearch.supervisor, "supervise_train")):
        monkeypatch.setattr(module, name, started)


def _overrides(tiny_model_dir, toy_data, tmp_path) -> list[str]:
    return [f"model.path={tiny_model_dir}", f"data.train_files=[{toy_data.train}]",
            f"tools.retriever.corpus={toy_data.corpus}", f"trainer.output_dir={tmp_path / 'run'}",
            f"rollout.context_window={LONG}", f"actor.max_tokens_per_microbatch={LONG}"]


def _memory_between_full_and_the_rest(overrides: list[str]) -> float:
    """GB of host memory in which this config fits with full recomputation and not without it (nor selective)."""
    config = load_train_config(EXAMPLE, overrides)
    inputs = train_memory_inputs(config, Device("cpu", 1e15, "any"))

    def needed(recompute: str) -> float:
        return plan_memory(dataclasses.replace(inputs, actor=dataclasses.replace(
            inputs.actor, recompute=recompute))).needed

    low, high = needed("full"), min(needed("selective"), needed("none"))
    assert low < high
    return (low + high) / 2 / GB


def test_a_run_that_does_not_fit_stops_before_anything_starts(tiny_model_dir, toy_data, tmp_path, capsys,
                                                              nothing_may_start):
    overrides = _overrides(tiny_model_dir, toy_data, tmp_path)
    memory = _memory_between_full_and_the_rest(overrides)
    code = main(["train", "--config", EXAMPLE, "--verbose", *overrides, f"trainer.device_memory_gb={memory}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "the memory plan does not fit: needs " in err, err
    assert f"of host memory at {LONG:,} tokens of {memory:,.2f} GB (host memory, trainer.device_memory_gb)" in err
    assert "; with actor.recompute=full, " in err and "trainer.memory_check=warn runs it anyway" in err
    assert "verdict : does NOT fit" in err  # the plan itself follows the message
    # the same under the supervisor (train --restarts): stopped before it starts a driver or Ray
    code = main(["train", "--config", EXAMPLE, "--verbose", "--restarts", "1", *overrides,
                 f"trainer.device_memory_gb={memory}"])
    assert code == 2 and "; with actor.recompute=full, " in capsys.readouterr().err


def test_memory_check_warn_runs_past_it_and_fits_with_the_suggested_change(tiny_model_dir, toy_data, tmp_path,
                                                                          capsys, nothing_may_start):
    from rlsearch.trainer import GRPOTrainer

    overrides = _overrides(tiny_model_dir, toy_data, tmp_path)
    memory = _memory_between_full_and_the_rest(overrides)
    config = load_train_config(EXAMPLE, [*overrides, f"trainer.device_memory_gb={memory}",
                                         "trainer.memory_check=warn"])
    with pytest.raises(Started):  # the next start-up phase: the tool servers start
        GRPOTrainer(config).train()
    out = capsys.readouterr().out
    assert "[rlsearch] warning: the memory plan does not fit: needs " in out
    assert "(trainer.memory_check=warn: running anyway)" in out
    config = load_train_config(EXAMPLE, [*overrides, f"trainer.device_memory_gb={memory}", "actor.recompute=full"])
    with pytest.raises(Started):
        GRPOTrainer(config).train()
    out = capsys.readouterr().out
    assert "warning" not in out, out
    fitting = plan_train_config(config)
    # between full recomputation's need and the others' it fits with little to spare (94%), which start-up says
    assert fitting.fits and fitting.needed >= QUIET_BELOW * fitting.inputs.device.memory
    assert f"[rlsearch] memory plan: {fitting.headline()} of {memory:,.1f} GB: fits" in out, out
    # with twice the memory it fits within QUIET_BELOW of it: start-up says nothing of the plan
    config = load_train_config(EXAMPLE, [*overrides, f"trainer.device_memory_gb={2 * memory}", "actor.recompute=full"])
    with pytest.raises(Started):
        GRPOTrainer(config).train()
    assert "[rlsearch] memory plan" not in capsys.readouterr().out


def test_rlsearch_plan_prints_the_plan_and_proposes_layouts(tmp_path, capsys):
    seven_b = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
               "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152_064,
               "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(seven_b))
    overrides = [f"model.path={tmp_path}", "model.dtype=bfloat16", "rollout.context_window=32768",
                 "actor.max_tokens_per_microbatch=32768"]
    assert main(["plan", "--config", EXAMPLE, *overrides, "--gpu-memory-gb", "80"]) == 2
    out = capsys.readouterr().out
    assert "verdict : does NOT fit" in out and "what would fit: needs " in out and "with actor.recompute=full" in out
    assert main(["plan", "--config", EXAMPLE, *overrides, "--gpu-memory-gb", "80", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    proposals = out.split("then no offloading):")[1].strip().splitlines()
    assert proposals and all(" GB per GPU  actor." in line for line in proposals)
    assert "actor.dp=8" in proposals[0]
