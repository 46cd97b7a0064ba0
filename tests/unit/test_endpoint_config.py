"""The config keys of failover endpoints, the browse agent, prebuilt indexes and loggers: bad values stop the run at
start-up, naming the key."""

from __future__ import annotations

import pytest

from rlsearch.config import ConfigError, load_train_config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward.judge.endpoints=[{url: 'http://a/v1', model: m}]", "reward.judge.base_url=http://b/v1"],
         r"'reward\.judge\.endpoints' lists the judges; base_url, model and api_key_env are the shorthand"),
        (["reward.judge.endpoints=[{url: 'http://a/v1'}]"], r"'reward\.judge\.endpoints\[0\]\.model' is empty"),
        (["reward.judge.endpoints=[{url: 'ftp://a', model: m}]"],
         r"'reward\.judge\.endpoints\[0\]\.url' must be an http\(s\) URL"),
        (["reward.judge.cooldown_s=-1"], r"'reward\.judge\.cooldown_s' must be >= 0"),
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
