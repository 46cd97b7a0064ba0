"""The config keys of failover endpoints, the browse agent, prebuilt indexes and loggers: bad values stop the run at
start-up, naming the key."""

from __future__ import annotations

import dataclasses

import pytest

from rlsearch.config import ConfigError, load_train_config
from rlsearch.config.schema import EndpointConfig


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward.judge.endpoints=[{url: 'http://a/v1', model: m}]", "reward.judge.base_url=http://b/v1"],
         r"'reward\.judge\.endpoints' lists the judges; base_url, model and api_key_env are the shorthand"),
        (["reward.judge.endpoints=[{url: 'http://a/v1'}]"], r"'reward\.judge\.endpoints\[0\]\.model' is empty"),
        (["reward.judge.endpoints=[{url: 'ftp://a', model: m}]"],
         r"'reward\.judge\.endpoints\[0\]\.url' must be an http\(s\) URL"),
        (["reward.judge.cooldown_s=-1"], r"'reward\.judge\.cooldown_s' must be >= 0"),
        (["reward.judge.engine=/no/such/model"],
         r"'reward\.judge\.engine' is /no/such/model, which is not a HuggingFace model dir \(no config\.json\)"),
        (["reward.judge.engine_url=http://a/v1"], r"'reward\.judge\.engine_url' is set by the run .* leave it empty"),
        (["tools.browse.summariser.deadline_s=-5"], r"'tools\.browse\.summariser\.deadline_s' must be >= 0"),
        (["tools.serper.endpoints=[{url: 'http://s', api_key_env: 'BAD-NAME'}]"],
         r"'tools\.serper\.endpoints\[0\]\.api_key_env' must name an environment variable"),
        (["tools.enabled=[browse]", "tools.browse.summariser.engine=/m",
          "tools.browse.summariser.endpoints=[{url: 'http://a/v1', model: m}]"],
         r"'tools\.browse\.summariser' takes endpoints .* or engine .*, not both"),
        (["tools.browse.summariser.engine=/m"],
         r"'tools\.browse\.summariser' is set but browse is not in tools\.enabled"),
        (["tools.enabled=[browse]", "tools.browse.summariser.max_tokens=0"],
         r"'tools\.browse\.summariser\.max_tokens' must be > 0"),
        (["tools.retriever.index=e5_Flat.index"], r"'tools\.retriever\.index' is a dense index .* set "
                                                  r"tools\.retriever\.backend=dense \(it is bm25\)"),
        (["tools.retriever.index=e5_Flat.index", "tools.retriever.backend=dense"],
         r"'tools\.retriever\.index' needs 'tools\.retriever\.encoder'"),
        (["tools.retriever.pooling=max"], r"'tools\.retriever\.pooling' must be one of auto, mean, cls, pooler"),
        (["trainer.loggers=[wandb]"], r"'trainer\.loggers' must include tensorboard"),
        (["trainer.loggers=[tensorboard, mlflow]"], r"'trainer\.loggers\[1\]' is 'mlflow'; the loggers are "
                                                    r"tensorboard, wandb"),
    ],
)
def test_bad_endpoint_browse_index_and_logger_keys_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(None, overrides)


def test_good_endpoint_browse_index_and_logger_keys_load():
    config = load_train_config(None, [
        "reward.judge.endpoints=[{url: 'http://a/v1', model: m}, {url: 'http://b/v1', model: n, api_key_env: K}]",
        "tools.enabled=[search, browse]", "tools.browse.summariser.engine=/models/summariser",
        "tools.retriever.index=e5_Flat.index", "tools.retriever.backend=dense", "tools.retriever.encoder=e5",
        "trainer.loggers=[tensorboard, wandb]",
    ])
    assert [endpoint.model for endpoint in config.reward.judge.endpoints] == ["m", "n"]
    assert config.tools.browse.summariser.engine == "/models/summariser"
    assert config.trainer.loggers == ["tensorboard", "wandb"]


def test_the_frozen_judge_engine_is_the_first_endpoint_and_names_the_cache_model(tiny_model_dir):
    """reward.judge.engine goes before the judges the config lists (their failover behind it), under its path as the
    model name (the cache key a replay reads), and the rubric generator uses it unless evolve lists its own."""
    from rlsearch.reward.judge import FROZEN_JUDGE_NOT_STARTED, judge_endpoints
    from rlsearch.reward.rubric_generator import generator_config

    engine = str(tiny_model_dir)
    listed = load_train_config(None, [f"reward.judge.engine={engine}",
                                      "reward.judge.endpoints=[{url: 'http://a/v1', model: m}]"]).reward
    assert [(e.url, e.model) for e in judge_endpoints(listed.judge)] == [
        (FROZEN_JUDGE_NOT_STARTED, engine), ("http://a/v1", "m")]
    started = dataclasses.replace(listed.judge, engine_url="http://10.0.0.2:4321/v1")
    assert judge_endpoints(started)[0].url == "http://10.0.0.2:4321/v1"
    alone = load_train_config(None, [f"reward.judge.engine={engine}", "reward.rubric.evolve.enabled=true"]).reward
    assert [e.model for e in judge_endpoints(alone.judge)] == [engine]
    assert [e.model for e in judge_endpoints(generator_config(alone)[0])] == [engine]
    own = dataclasses.replace(alone, rubric=dataclasses.replace(alone.rubric, evolve=dataclasses.replace(
        alone.rubric.evolve, endpoints=[EndpointConfig("http://g/v1", "g")])))
    assert [e.model for e in judge_endpoints(generator_config(own)[0])] == ["g"]
