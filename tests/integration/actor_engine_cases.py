"""The actor/engine tests: a Megatron actor (Ray, gloo) and a vLLM engine, logprob parity and a GRPO step the engine
follows. Two test modules collect them, each with its own `rollout_worker`, `actor_ranks` and `tiny_model_dir`:
test_actor_engine.py (the session's shared engine and ranks) and test_tied_sync.py (a model with tied embeddings)."""

import ray
import torch

from rlsearch.actor import MODEL_DISTRIBUTION, TrainSample
from rlsearch.algo import grpo_advantages, loss_token_weights
from rlsearch.data import load_qa_dataset
from rlsearch.rollout import PromptItem
from rlsearch.weights import WeightSync, logprob_mismatch

PROBE = "<search> who founded the town </search>"


def _probe(rollout_worker) -> list[int]:
    return ray.get(rollout_worker.probe_sequence.remote("Who is the mayor of Velmora?", PROBE))


def _actor_logprobs(actor_ranks, ids):
    return actor_ranks.compute_logprobs([TrainSample(ids, 1, [1] * (len(ids) - 1))], distribution=MODEL_DISTRIBUTION)[0]


def test_actor_matches_hf_and_engine_logprobs(rollout_worker, actor_ranks, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    ids = _probe(rollout_worker)
    actor = _actor_logprobs(actor_ranks, ids)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)
    hf_logprobs = [reference[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert logprob_mismatch(hf_logprobs, actor)[0] < 1e-5
    engine = ray.get(rollout_worker.score.remote(ids))
    assert logprob_mismatch(engine, actor)[0] < 1e-4


def test_grpo_step_changes_weights_and_engine_follows(rollout_worker, actor_ranks, toy_data):
    examples = load_qa_dataset(toy_data.train)[:2]
    items = [PromptItem(e.id, e.question, i, s) for i, e in enumerate(examples) for s in range(4)]
    trajectories = ray.get(rollout_worker.generate.remote(items, 2))
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0])  # synthetic: a random model earns none
    advantages = grpo_advantages(rewards, [t.group_id for t in trajectories])
    weights = loss_token_weights([t.loss_mask for t in trajectories], "token_mean")
    samples = [
        TrainSample(t.token_ids, len(t.prompt_ids), t.loss_mask, float(a), w, rollout_logprobs=t.rollout_logprobs)
        for t, a, w in zip(trajectories, advantages, weights)
    ]
    before_logprobs = actor_ranks.compute_logprobs(samples)
    before_weights = actor_ranks.hf_state_dict()
    probe = _probe(rollout_worker)
    engine_before = ray.get(rollout_worker.score.remote(probe))

    metrics = actor_ranks.train_step(samples)
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/update_ok"] == 1.0
    assert metrics["rollout/actor_logprob_diff_mean"] < 1e-4  # on-policy: engine and actor agree per token
    after_weights = actor_ranks.hf_state_dict()
    changed = [name for name in before_weights if not torch.equal(before_weights[name], after_weights[name])]
    assert len(changed) == len(before_weights)

    # the step climbed the policy-gradient objective sum(weight * advantage * logprob)
    def objective(logprobs):
        return sum(float(a) * w * lp for a, ws, lps in zip(advantages, weights, logprobs) for w, lp in zip(ws, lps))

    gain = objective(actor_ranks.compute_logprobs(samples)) - objective(before_logprobs)
    assert gain > 0.01

    stats = WeightSync(actor_ranks, 1, "shm", 120.0, engine_tp=1).sync([rollout_worker])
    assert stats.num_buckets >= 3 and stats.num_tensors == len(after_weights)
    engine_after = ray.get(rollout_worker.score.remote(probe))
    assert logprob_mismatch(engine_after, _actor_logprobs(actor_ranks, probe))[0] < 1e-4
    assert logprob_mismatch(engine_after, engine_before)[0] > 1e-3
