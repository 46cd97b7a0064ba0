"""actor.lora: its defaults, and the settings refused at start-up with the key named: by the config alone, by the
cluster's devices and by the model (a MoE model's experts)."""

from __future__ import annotations

import json

import pytest

from rlsearch.config import ActorConfig, ConfigError, TrainConfig, check_actor_devices, check_model_layout
from rlsearch.config import load_train_config as load


def test_lora_is_off_by_default_and_adapts_every_linear_layer_when_on():
    lora = TrainConfig().actor.lora
    assert (lora.rank, lora.alpha, lora.targets, lora.dropout) == (0, 16.0, ["qkv", "proj", "fc1", "fc2"], 0.0)
    config = load(None, ["actor.lora.rank=8", "actor.lora.alpha=32", "actor.lora.targets=[qkv,proj]"])
    assert (config.actor.lora.rank, config.actor.lora.alpha, config.actor.lora.targets) == (8, 32.0, ["qkv", "proj"])


def test_the_critic_trains_all_its_weights_whatever_actor_lora_says():
    config = load(None, ["actor.lora.rank=8", "algo.advantage=gae"])
    assert config.critic.ranks_config(config.actor).lora.rank == 0


@pytest.mark.parametrize("override, message", [
    ("actor.lora.rank=-1", r"'actor\.lora\.rank' must be 0 \(off\) or >= 1; got -1"),
    ("actor.lora.alpha=0", r"'actor\.lora\.alpha' must be > 0; got 0\.0"),
    ("actor.lora.dropout=1.0", r"'actor\.lora\.dropout' must be in \[0, 1\); got 1\.0"),
    ("actor.lora.targets=[]", r"'actor\.lora\.targets' is empty: name the linear layers to adapt \(qkv, proj, fc1, "
                              r"fc2\), or set actor\.lora\.rank=0"),
    ("actor.lora.targets=[qkv,lm_head]", r"'actor\.lora\.targets\[1\]' is 'lm_head'; the targets are qkv, proj, fc1, "
                                         r"fc2 \(the embedding and output layer are never adapted: Qwen2's are one "
                                         r"tied matrix, and vLLM leaves an output-layer adapter out of prompt "
                                         r"logprobs\)"),
    ("actor.lora.targets=[embedding]", r"'actor\.lora\.targets\[0\]' is 'embedding'; the targets are qkv"),
])
def test_bad_lora_settings_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load(None, ["actor.lora.rank=4", override])


@pytest.mark.parametrize("overrides, message", [
    (["actor.lora.sync=adapter"], r"'actor\.lora\.sync' is adapter but actor\.lora\.rank is 0 \(no adapters to send\)"),
    (["actor.lora.rank=640", "actor.lora.sync=adapter"],
     r"'actor\.lora\.rank' is 640 with actor\.lora\.sync=adapter: vLLM serves adapters of rank up to 512"),
    (["actor.lora.rank=8", "actor.lora.sync=adapter", "weights.delta=true"],
     r"'weights\.delta' is true with actor\.lora\.sync=adapter: an adapter sync sends the adapters whole"),
    (["actor.lora.rank=8", "actor.lora.sync=both"], r"'actor\.lora\.sync' must be one of merged, adapter; got 'both'"),
])
def test_an_adapter_sync_the_engines_cannot_serve_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(None, overrides)


@pytest.mark.parametrize("rank, served", [(1, 1), (4, 8), (12, 16), (16, 16), (400, 512)])
def test_an_adapter_syncs_engines_take_vllms_least_max_lora_rank_at_or_above_the_rank(rank, served):
    from rlsearch.config import EngineSpec

    config = load(None, [f"actor.lora.rank={rank}", "actor.lora.sync=adapter"])
    spec = EngineSpec.from_config(config.model, config.rollout, 1, lora_rank=config.actor.lora.rank)
    assert (spec.lora_rank, spec.max_lora_rank) == (rank, served)


def test_lora_on_transformer_engines_layers_is_refused_at_start_up():
    with pytest.raises(ConfigError, match=r"'actor\.lora\.rank' is 4 with actor\.transformer_impl=transformer_engine: "
                                          r"the adapters wrap the local layer spec's linear layers"):
        load(None, ["actor.lora.rank=4", "actor.transformer_impl=transformer_engine"])
    lora = load(None, ["actor.lora.rank=4"]).actor
    # auto builds Transformer Engine's spec where the ranks have GPUs: said once the driver knows the cluster
    with pytest.raises(ConfigError, match=r"'actor\.lora\.rank' is 4 with actor\.transformer_impl=auto on a cluster "
                                          r"with GPUs: .* set actor\.transformer_impl=local"):
        check_actor_devices(lora, has_gpus=True, dtype="bfloat16")
    check_actor_devices(lora, has_gpus=False, dtype="float32")
    local = load(None, ["actor.lora.rank=4", "actor.transformer_impl=local"]).actor
    check_actor_devices(local, has_gpus=True, dtype="bfloat16")


def test_lora_on_a_moe_models_experts_is_refused_naming_the_targets(tmp_path):
    shape = {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "num_hidden_layers": 2}
    moe, dense = tmp_path / "moe", tmp_path / "dense"
    for directory, extra in ((moe, {"num_experts": 4}), (dense, {})):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({**shape, **extra}))
    with pytest.raises(ConfigError, match=rf"'actor\.lora\.targets' has fc1 and fc2 but the MLPs of {moe} are "
                                          r"mixture-of-experts layers: adapters on experts are not supported .*"
                                          r"actor\.lora\.targets=\[qkv,proj\]"):
        check_model_layout(moe, ActorConfig(lora=load(None, ["actor.lora.rank=4"]).actor.lora))
    with pytest.raises(ConfigError, match=r"'actor\.lora\.targets' has fc2 but"):
        check_model_layout(moe, load(None, ["actor.lora.rank=4", "actor.lora.targets=[qkv,fc2]"]).actor)
    check_model_layout(moe, load(None, ["actor.lora.rank=4", "actor.lora.targets=[qkv,proj]"]).actor)
    check_model_layout(moe, ActorConfig())  # off: nothing to refuse
    check_model_layout(dense, load(None, ["actor.lora.rank=4"]).actor)
