"""Rollouts with native tool calls (rollout.protocol=chat_tools) on the tiny model: a real vLLM engine in this
process (a RolloutWorker, as `rlsearch eval` runs it) and the real BM25 retrieval server over HTTP.

A random-init model writes no tool call of its own: the first turn is prefilled with two complete calls (the second
with a typed integer argument) and <|im_end|> is biased, so that the model ends some turns itself and others are cut
at max_tokens_per_turn (their observation starts with an inserted <|im_end|>): with the bias, a turn of 32 sampled
tokens ends by itself about half the time, so that both kinds occur among 16 first turns on any CPU's sample path.
"""

import json

import pytest

from rlsearch.config import RetrieverConfig, RolloutConfig
from rlsearch.data import load_qa_dataset
from rlsearch.rollout import EngineSpec, PromptItem, RolloutWorker
from rlsearch.tools import Document, RetrievalClient
from rlsearch.tools.protocols.chat_tools import KNOWN_SEAMS, template_mismatches
from rlsearch.trainer.metrics import trajectory_metrics
from tests.constants import TEST_KV_CACHE_GIB
from tests.integration.rollout_checks import assert_masks_follow_turns

CALLS = ({"query": "mayor"}, {"query": "river", "topk": 1})  # the retriever's default 2 passages, then 1
PREFILL = "\n".join(f"<tool_call>\n{json.dumps({'name': 'search', 'arguments': a})}\n</tool_call>" for a in CALLS)
CHAT_TOOLS_ROLLOUT = {
    "protocol": "chat_tools", "max_turns": 3, "max_response_tokens": 400, "max_tokens_per_turn": 32,
    "assistant_prefix": PREFILL, "logit_bias": {"<|im_end|>": 6.0},
}


@pytest.fixture(scope="module")
def chat_worker(tiny_model_dir, retriever):
    worker = RolloutWorker(
        EngineSpec(str(tiny_model_dir), kv_cache_gib=TEST_KV_CACHE_GIB, max_model_len=1024),
        RolloutConfig(**CHAT_TOOLS_ROLLOUT),
        RetrieverConfig(topk=2, max_retries=1, backoff_s=0.05, timeout_s=5.0), retriever.url, 1,
    )
    yield worker
    worker.shutdown()


def test_native_tool_calls_run_in_call_order_with_token_exact_observations(chat_worker, toy_data, retriever):
    examples = load_qa_dataset(toy_data.train)[:4]
    items = [PromptItem(e.id, e.question, group_id=i, sample_index=s) for i, e in enumerate(examples) for s in range(4)]
    trajectories = chat_worker.generate(items, 1)
    tokenizer, protocol = chat_worker.engine.tokenizer, chat_worker.loop.protocol
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert protocol.stop_token_ids == (end_of_turn,)

    # what the two calls must have returned, in this order: the retriever asked directly
    client = RetrievalClient(retriever.url, topk=2)
    hits = [client.search([arguments["query"]], arguments.get("topk"))[0] for arguments in CALLS]
    expected = [protocol.observation([Document.from_passage(d["contents"], str(d["id"])) for d in h]) for h in hits]
    client.close()
    assert (expected[0].count("\n\n[2] "), expected[1].count("[2] ")) == (1, 0)  # two passages, then one

    ended = cut = 0
    seams: dict[str, int] = {}
    for trajectory in trajectories:
        first = trajectory.turns[0]
        assert [(c.name, c.arguments, c.ok) for c in first.tool_calls] == [("search", a, True) for a in CALLS]
        assert first.tool_outputs == expected
        assert first.observation.endswith(
            "\n<|im_start|>user\n" + "\n".join(f"<tool_response>\n{o}\n</tool_response>" for o in expected)
            + "<|im_end|>\n<|im_start|>assistant\n"
        )
        # the first turn ended with a sampled <|im_end|> (the seam "\n" follows, mask 0) or was cut before it
        # (the observation inserts <|im_end|>, mask 0)
        turn_end = first.num_tokens
        if trajectory.response_ids[turn_end - 1] == end_of_turn:
            ended += 1
            assert first.observation.startswith("\n<|im_start|>user\n")
        else:
            cut += 1
            assert first.observation.startswith("<|im_end|>\n<|im_start|>user\n")
            assert (trajectory.response_ids[turn_end], trajectory.loss_mask[turn_end]) == (end_of_turn, 0)
        assert assert_masks_follow_turns(trajectory, tokenizer) == len(trajectory.turns) - 1 >= 1
        sampled = [lp for lp, mask in zip(trajectory.rollout_logprobs, trajectory.loss_mask) if mask]
        assert all(lp <= 0.0 for lp in sampled) and any(lp < 0.0 for lp in sampled)
        # merged ids == the template's rendering of the whole conversation, except at the known seams
        question = examples[trajectory.group_id].question
        mismatches = template_mismatches(protocol, chat_worker.loop.prompt_messages(question), trajectory)
        assert [m for m in mismatches if m.seam is None] == []
        assert mismatches[-1].seam == "end"
        for mismatch in mismatches:
            seams[mismatch.seam] = seams.get(mismatch.seam, 0) + 1
    print(f"\nfirst turns: {ended} ended by the model, {cut} cut")
    assert ended + cut == len(trajectories) == 16 and ended > 0 and cut > 0
    assert set(seams) <= set(KNOWN_SEAMS) and seams["end"] == len(trajectories)

    metrics = trajectory_metrics(trajectories)
    assert metrics["rollout/tool_calls/search"] >= 2 * len(trajectories) and metrics["rollout/tool_errors"] == 0.0
