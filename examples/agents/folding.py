"""A folding deep-research agent: Search-R1 turns for as many turns as it takes, its context kept short by having the
model summarise what it found and starting over from the question and that summary (use it with
rollout.agent=examples.agents.folding:agent).

The loop is examples/agents/search_r1.py's, with its turn request and search results (`write_turn`, `observation`,
so this module needs that one beside it): one assistant message that grows turn by turn, continued with vLLM's
`continue_final_message`, each `<search>` answered by an `<information>` block. After every turn the agent reads
how long its context has grown from the usage the endpoint returns (`usage.total_tokens`: the call's prompt and
what the model wrote). Once that reaches `fold_at` tokens, it appends the fold request, asks for the summary
(generation stops at `</summary>`, at most `summary_tokens` tokens), and starts a fresh message list: the question,
followed by the summary, in the run's instruction. The model goes on from there, for up to `session.max_turns`
search turns in all (the summaries come on top).

Request, summary extraction and folded question are the built-in loop's (`rollout.context=fold`, in
rlsearch.rollout.agent_loop), so both fold with the same words and a folded segment starts from the same prompt
ids. Two differences: the built-in loop checks the context after the latest search result, this agent checks it
just before the search result is added (usage cannot count text the agent has not sent yet); and the settings
here are the function's keyword arguments, not rollout.manage_context_at and rollout.summary_tokens.

Training. Rewriting the history starts a new segment on the endpoint (rlsearch/rollout/session/tokens.py): each
fold ends one segment and starts the next one. Every segment is a training sample with the trajectory's
advantage, and the summary is sampled, so it is trained (loss mask 1) in the segment that wrote it.

Settings. A call's context is held to rollout.max_response_tokens past the first prompt, so set that (and the
engine's context window) above `fold_at` plus one round: a turn, two search results, the fold request and the
summary. To fold at other lengths, point rollout.agent at your own module::

    # my_agents.py
    import functools
    from examples.agents import folding

    agent = functools.partial(folding.agent, fold_at=12_000, summary_tokens=512)
"""

from openai import AsyncOpenAI

from examples.agents.search_r1 import CONTINUE, PROTOCOL, observation, write_turn
from rlsearch.tools import TurnKind
from rlsearch.tools.protocols.folding import FOLD_INSTRUCTION, FOLDED_QUESTION, SUMMARY_CLOSE, summary_text

FOLD_AT = 6144  # context tokens (prompt, turns, search results) at which the agent folds
SUMMARY_TOKENS = 256  # the most tokens of one summary


async def agent(session, example, fold_at: int = FOLD_AT, summary_tokens: int = SUMMARY_TOKENS) -> str | None:
    client: AsyncOpenAI = session.openai()  # the official client, pointed at this trajectory's endpoint
    messages = list(example.prompt_messages)
    response = session.assistant_prefix  # text prefilled at the start of the answer ("" for a trained model)
    fresh = True  # the message holds only the prefill: the next turn is the first of its segment
    for turn in range(session.max_turns):
        chat = await write_turn(client, session, messages, response)
        text = chat.choices[0].message.content
        parsed = PROTOCOL.parse_turn((session.assistant_prefix if fresh else "") + text)  # the prefill opens a tag
        response, fresh = response + text, False
        if parsed.kind == TurnKind.ANSWER:
            return parsed.answer
        if parsed.kind == TurnKind.NONE or turn == session.max_turns - 1:
            return None  # no tag: the model ended (or ran out of tokens); the scorer finds no answer
        response += await observation(session, parsed)
        if chat.usage.total_tokens >= fold_at:
            summary = await summarise(client, session, messages, response, summary_tokens)
            messages = folded_messages(example, summary)
            response, fresh = session.assistant_prefix, True
    return None


async def summarise(client: AsyncOpenAI, session, messages: list[dict], response: str, max_tokens: int) -> str:
    """The model's summary of its context: the fold request is appended to the answer, the model writes on."""
    chat = await client.chat.completions.create(
        model=session.model,
        messages=[*messages, {"role": "assistant", "content": response + PROTOCOL.wrap(FOLD_INSTRUCTION)}],
        stop=[SUMMARY_CLOSE], max_tokens=max_tokens, extra_body=CONTINUE,
    )
    return summary_text(chat.choices[0].message.content)


def folded_messages(example, summary: str) -> list[dict]:
    """The example's own messages with the question grown by the summary (the run's system prompt and instruction
    stay as they are). A prompt that does not quote the question gets the summary as a user turn of its own."""
    folded = FOLDED_QUESTION.format(question=example.question, summary=summary)
    *before, last = example.prompt_messages
    head, found, tail = last["content"].rpartition(example.question)
    if not found:
        return [*example.prompt_messages, {"role": "user", "content": folded}]
    return [*before, {**last, "content": head + folded + tail}]
