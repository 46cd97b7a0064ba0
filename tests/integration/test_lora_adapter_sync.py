"""actor.lora.sync=adapter into two engines with vLLM's LoRA on (one TP1, one TP2): the engines keep the base model
and get only the adapters, in place, each sync.

A TP2 LoRA actor (rank 4: the engines take vLLM's max_lora_rank 8) trains, and each sync is followed by the probe
check the trainer runs: every engine samples from the adapted model and the actor scores its tokens. Before the first
sync the actor and the engines agree (B starts at zero); after training and before a sync they do not (the probe
would catch an adapter that did not apply); after it they do again, the second sync replacing the adapter the first
loaded. The PEFT adapter `rlsearch convert --peft-adapter` writes from the step-1 checkpoint, its two files as they are
on disk, serves the step-1 actor's logprobs from an engine that had step 2's. An adapter whose modules match no layer
of the model is refused by name (vLLM would skip them silently and serve the base model)."""

from __future__ import annotations

import json

import pytest
import ray
from safetensors.torch import load_file

from rlsearch.actor import MODEL_DISTRIBUTION, SamplingDistribution, TrainSample
from rlsearch.checkpoint import mcore_to_hf
from rlsearch.config import RetrieverConfig, RolloutConfig
from rlsearch.config.schema import LoRAConfig
from rlsearch.megatron.lora import peft_config
from rlsearch.rollout import EngineSpec, RolloutWorker
from rlsearch.weights import AdapterSync, check_engines_match_actor, logprob_mismatch
from tests.constants import TEST_KV_CACHE_GIB, TEST_ROLLOUT
from tests.integration.actor_helpers import (
    actor_spec,
    hf_logprobs,
    save_lora_checkpoint,
    scored_batch,
    sent_adapters,
)

pytestmark = pytest.mark.memory_heavy  # two engines (three vLLM workers) and two actor ranks at once

LORA = LoRAConfig(rank=4, alpha=8.0, sync="adapter")
ENGINE_TPS = (1, 2)
PROBE = ("Who is the mayor of Velmora?", "<search> who founded the town </search>")
LIMIT = 1e-4  # the probe check's fp32 limit (weights.max_logprob_mismatch's default is looser)


@pytest.fixture(scope="module")
def engines(ray_local, tiny_model_dir, retriever):
    handles = []
    try:
        for index, tp in enumerate(ENGINE_TPS):  # side by side, as a run's pool starts them
            spec = EngineSpec(str(tiny_model_dir), kv_cache_gib=TEST_KV_CACHE_GIB, max_model_len=768, seed=index,
                              tensor_parallel_size=tp, vllm_port=29800 + 100 * index, lora_rank=LORA.rank)
            handles.append(ray.remote(RolloutWorker).options(num_cpus=0, max_concurrency=8).remote(
                spec, RolloutConfig(**TEST_ROLLOUT), RetrieverConfig(topk=2), retriever.url, 1))
        ray.get([handle.__ray_ready__.remote() for handle in handles])
        yield handles
    finally:
        for handle in handles:
            ray.kill(handle)


def _actor_probe(group, probe_ids):
    probe = TrainSample(probe_ids, 1, [1] * (len(probe_ids) - 1))
    return group.compute_logprobs([probe], distribution=MODEL_DISTRIBUTION)[0]  # as `score` takes them


def _engine_gaps(engines, group, probe_ids) -> list[float]:
    """Per engine, the largest gap between its teacher-forced logprobs of the probe and the actor's."""
    actor = _actor_probe(group, probe_ids)
    return [logprob_mismatch(ray.get(engine.score.remote(probe_ids)), actor)[0] for engine in engines]


def test_adapter_sync_into_two_engines_matches_the_actor_each_step(engines, tiny_model_dir, rank_pool, tmp_path):
    probe_ids = ray.get(engines[0].probe_sequence.remote(*PROBE))
    sampling = SamplingDistribution(1.0, ray.get(engines[0].token_logit_bias.remote()))
    samples, _ = scored_batch(lambda s: hf_logprobs(tiny_model_dir, s))
    spec = actor_spec(tiny_model_dir, 2, 1, 1, {"lora": LORA, "lr": 1e-3}, sampling)
    with rank_pool.group(spec) as group:
        sync = AdapterSync(group, LORA.rank, LORA.alpha, timeout_s=120.0)
        assert max(_engine_gaps(engines, group, probe_ids)) < LIMIT  # step 0: B = 0, the base model on both sides
        stats, gaps_before, parity = [], [], []
        for version in (1, 2):
            group.train_step(samples)
            gaps_before.append(_engine_gaps(engines, group, probe_ids))
            stats.append(sync.sync(engines, version))
            parity.append(check_engines_match_actor(group, engines, probe_ids, LIMIT, step=version))
            assert max(_engine_gaps(engines, group, probe_ids)) < LIMIT
            if version == 1:
                checkpoint = save_lora_checkpoint(tmp_path / "run", 1, group, tiny_model_dir, 2, LORA)
                actor_at_step_1 = _actor_probe(group, probe_ids)
        model_bytes = sum(p.nbytes for p in _model_tensors(tiny_model_dir))

        # the exported PEFT adapter of step 1, as a user serves it: the TP2 engine scores the step-1 actor's logprobs
        peft_dir = tmp_path / "peft"
        mcore_to_hf(checkpoint, None, peft_adapter_dir=peft_dir)
        ray.get(engines[1].load_policy_adapter.remote(load_file(str(peft_dir / "adapter_model.safetensors")),
                                                      json.loads((peft_dir / "adapter_config.json").read_text())))
        served = ray.get(engines[1].score.remote(probe_ids))
        assert logprob_mismatch(served, actor_at_step_1)[0] < LIMIT
        assert logprob_mismatch(served, _actor_probe(group, probe_ids))[0] > 10 * LIMIT  # not step 2's any more

        # an adapter whose modules name no layer of the model: refused, naming them (the engine stays paused)
        adapters = sent_adapters(group)
        renamed = {name.replace("mlp.down_proj", "mlp.no_such_proj"): tensor for name, tensor in adapters.items()}
        with pytest.raises(ray.exceptions.RayTaskError, match="matched no layer of the model.*no_such_proj"):
            ray.get(engines[0].load_policy_adapter.remote(renamed, peft_config(LORA.rank, LORA.alpha, renamed)))
    assert all(min(gaps) > 10 * LIMIT for gaps in gaps_before), gaps_before  # each sync had something to fix
    assert all(item["weights/logprob_mismatch_max"] < LIMIT for item in parity)
    for sent in stats:
        assert sent.num_engines == len(ENGINE_TPS) and sent.num_tensors == len(adapters)
        assert sent.num_bytes * 20 <= model_bytes  # the goal: <= 1/20 of a full sync's bytes
    assert ray.get([engine.finished_weight_syncs.remote() for engine in engines[1:]]) == [3]  # the PEFT load too


def _model_tensors(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors")).values()
