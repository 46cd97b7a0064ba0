"""The folding agent of examples/agents (examples/agents/folding.py) over a long horizon, on the session's real vLLM
engine and BM25 server (`engine_bench`), through the session endpoint.

The tiny model is rewired into a policy that searches every turn (`search_automaton_weights`, as in
test_long_horizon.py), so a 30-turn trajectory grows by a search result each turn and folds several times at a small
threshold; the session's weights come back afterwards. Every call the agent makes is recorded (request and
response) and checked against the trajectory's segments.
"""

from __future__ import annotations

from examples.agents import folding
from rlsearch.tools.protocols.folding import FOLD_INSTRUCTION, FOLDED_QUESTION, SUMMARY_CLOSE, summary_text
from tests.integration.engine_bench import prompt_items, sampled_runs

TURNS = 30
FOLD_AT = 768  # ~7 turns of the search_automaton (a few tokens and two retrieved passages each) past the prompt
SUMMARY_TOKENS = 48
TURN_TOKENS = 16
ROLLOUT = {"max_turns": TURNS, "max_response_tokens": 2048, "max_tokens_per_turn": TURN_TOKENS, "logit_bias": {}}


def recording(calls: dict):
    """The folding agent at this test's threshold, its client recording every call: (request, response) per group."""

    async def agent(session, example):
        client = session.openai()
        create = client.chat.completions.create

        async def recorded(**request):
            response = await create(**request)
            calls.setdefault(example.group_id, []).append((request, response))
            return response

        client.chat.completions.create = recorded
        session.openai = lambda: client
        return await folding.agent(session, example, fold_at=FOLD_AT, summary_tokens=SUMMARY_TOKENS)

    return agent


def test_folding_agent_runs_30_turns_in_folded_segments_of_what_was_sampled(search_automaton, toy_data):
    items = prompt_items(toy_data, prompts=2, samples=1)
    calls: dict = {}
    trajectories = search_automaton.agent(recording(calls), items, step=1, **ROLLOUT)
    loop, tokenizer = search_automaton.loop(**ROLLOUT), search_automaton.engine.tokenizer
    prefix = loop.config.assistant_prefix  # "<search>": the search_automaton's turns start searching
    fold_request = folding.PROTOCOL.wrap(FOLD_INSTRUCTION)

    for item, trajectory in zip(items, trajectories):
        assert not trajectory.failed and trajectory.finish_reason == "eos"  # ran out of turns without an answer
        made = calls[item.group_id]
        folds = len(trajectory.segments) - 1
        assert folds >= 2
        assert sum(request["stop"] == [SUMMARY_CLOSE] for request, _ in made) == folds
        assert len(made) == len(trajectory.turns) == TURNS + folds
        # a long horizon: the segments together hold several thresholds' worth of tokens
        assert sum(len(s.prompt_ids) + len(s.response_ids) for s in trajectory.segments) > 3 * FOLD_AT

        assert trajectory.segments[0].prompt_ids == loop.prompt_ids(item.question)  # the example's own prompt
        position, longest = 0, 0  # the index in `made` of each segment's first call
        for index, segment in enumerate(trajectory.segments):
            runs = sampled_runs(segment)
            mine = made[position: position + len(runs)]
            position += len(runs)
            # each segment but the last ends with its summary call, and only then
            is_summary = [request["stop"] == [SUMMARY_CLOSE] for request, _ in mine]
            assert is_summary == [index < folds and call == len(runs) - 1 for call in range(len(runs))]
            context = segment.prompt_ids + segment.response_ids
            mask = [0] * len(segment.prompt_ids) + segment.loss_mask
            trained = [0] * len(context)
            totals = []
            for (_, response), run in zip(mine, runs):
                prompt, sampled = response.model_extra["prompt_token_ids"], response.choices[0].model_extra["token_ids"]
                # the ids the engine sampled, as they are, after the prompt the endpoint sent it: trained (mask 1)
                assert run == sampled and context[: len(prompt)] == prompt
                assert context[len(prompt): len(prompt) + len(sampled)] == sampled
                assert mask[len(prompt): len(prompt) + len(sampled)] == [1] * len(sampled)
                trained[len(prompt): len(prompt) + len(sampled)] = [1] * len(sampled)
                assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt), len(sampled))
                totals.append(response.usage.total_tokens)
            assert trained == mask  # everything else (search results, the fold request) is loss mask 0
            assert mine[0][1].model_extra["prompt_token_ids"] == segment.prompt_ids

            # the threshold: a search call follows a context below FOLD_AT, a summary the first turn that reached
            # it. So no call saw more than FOLD_AT plus two rounds (a turn and its search result), the fold request
            # and the summary
            for call in range(1, len(mine)):
                assert (totals[call - 1] >= FOLD_AT) == is_summary[call]
            rounds = [after - before for before, after, summary in zip(totals, totals[1:], is_summary[1:])
                      if not summary]
            largest = FOLD_AT - 1 + 2 * max(rounds, default=0) + len(tokenizer.encode(fold_request)) + SUMMARY_TOKENS
            assert max(totals) <= largest < FOLD_AT + 400
            longest = max(longest, max(totals))

            if index < folds:  # the summary is the segment's last call, trained where it was written
                summary = mine[-1][1].choices[0].message.content
                written = len(runs[-1])
                assert 0 < written <= SUMMARY_TOKENS
                assert segment.loss_mask[-written:] == [1] * written
                assert tokenizer.decode(segment.response_ids[-written:]) == summary
                asked = segment.loss_mask[:-written][::-1].index(1)  # the tokens between the last turn and it
                assert tokenizer.decode(segment.response_ids[-written - asked: -written]).endswith(fold_request)
                # the next segment starts from the question and this summary, rendered by the chat template: the
                # prompt the built-in loop's fold starts from
                folded = FOLDED_QUESTION.format(question=item.question, summary=summary_text(summary))
                messages = [{"role": "user", "content": search_automaton.protocol.instruction(folded)}]
                rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                following = trajectory.segments[index + 1].prompt_ids
                assert following == tokenizer.encode(rendered + prefix, add_special_tokens=False)
                assert following == loop.folded_prompt_ids(item.question, summary_text(summary))
        assert position == len(made) and longest >= FOLD_AT

        # every call is a turn of the trajectory, its text the decoding of the ids it sampled
        turns = [run for segment in trajectory.segments for run in sampled_runs(segment)]
        assert [tokenizer.decode(run) for run in turns] == [turn.text for turn in trajectory.turns]
        assert [response.choices[0].message.content for _, response in made] == [t.text for t in trajectory.turns]
        searches = [turn for turn in trajectory.turns if turn.tool_calls]
        assert len(searches) == TURNS - 1 and all(turn.tool_calls[0].ok for turn in searches)
