"""RL trains without the dropout a model's config.json has (actor.dropout=off): the logprob passes and the engines run
without it, and dropout in the update alone would move the on-policy ratio off 1. Start-up says so; actor.dropout=model
(SFT's default) keeps it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlsearch.config import SFTConfig, TrainConfig, dropout_turned_off, load_train_config
from tests.models import linked_model


@pytest.fixture
def dropout_model(tiny_model_dir, tmp_path) -> Path:
    """The tiny model with attention_dropout and hidden_dropout 0.1 in its config.json."""
    model = linked_model(tiny_model_dir, tmp_path / "model", but=("config.json",))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1, "hidden_dropout": 0.1}))
    return model


def test_the_actors_transformer_config_has_no_dropout_unless_the_model_is_asked_for(dropout_model, monkeypatch):
    from mbridge.core.parallel_states import ParallelStates

    from rlsearch.megatron.model import make_bridge

    # one rank of every parallel group, without a process group: the bridge only builds its TransformerConfig
    monkeypatch.setattr(ParallelStates, "get_parallel_state", classmethod(lambda cls: cls()))
    trained = make_bridge(str(dropout_model), torch.float32, "local", on_cpu=True).config
    assert (trained.attention_dropout, trained.hidden_dropout) == (0.0, 0.0)
    kept = make_bridge(str(dropout_model), torch.float32, "local", on_cpu=True, model_dropout=True).config
    assert (kept.attention_dropout, kept.hidden_dropout) == (0.1, 0.1)


def test_start_up_says_the_models_dropout_is_turned_off(dropout_model, tiny_model_dir):
    assert (TrainConfig().actor.dropout, SFTConfig().actor.dropout) == ("off", "model")
    assert dropout_turned_off(load_train_config(None, [f"model.path={dropout_model}"])) == (
        f"[rlsearch] actor.dropout=off: training without the dropout of {dropout_model / 'config.json'} "
        "(attention_dropout 0.1, hidden_dropout 0.1), as the logprob passes and the engines run; actor.dropout=model "
        "trains with it")
    assert dropout_turned_off(load_train_config(None, [f"model.path={dropout_model}", "actor.dropout=model"])) == ""
    assert dropout_turned_off(load_train_config(None, [f"model.path={tiny_model_dir}"])) == ""  # it has none
    critic = load_train_config(None, [f"model.path={tiny_model_dir}", "algo.advantage=gae",
                                      f"critic.model.path={dropout_model}"])
    assert f"the dropout of {dropout_model / 'config.json'} (attention_dropout 0.1" in dropout_turned_off(critic)
