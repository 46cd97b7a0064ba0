"""A Search-R1 agent written as plain Python on the `openai` client (use it with rollout.agent=
examples.agents.search_r1:agent).

The answer is one assistant message that grows turn by turn: the model writes until `</search>` or `</answer>`, the
search result is appended as `<information>`, and the next call continues the same message (vLLM's
`continue_final_message`). Tags, parsing and observation text are the built-in search_r1 protocol's, so with the
same seeds this agent samples exactly the tokens of the built-in loop. Every call is recorded by the endpoint:
the trainer sees the sampled token ids (loss mask 1) and everything appended in between (loss mask 0).
"""

from openai import AsyncOpenAI

from rlsearch.tools import SearchR1Protocol, TurnKind

PROTOCOL = SearchR1Protocol()
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


async def agent(session, example) -> str | None:
    client: AsyncOpenAI = session.openai()  # the official client, pointed at this trajectory's endpoint
    response = session.assistant_prefix  # text prefilled at the start of the answer ("" for a trained model)
    for turn in range(session.max_turns):
        chat = await write_turn(client, session, example.prompt_messages, response)
        text = chat.choices[0].message.content
        parsed = PROTOCOL.parse_turn((response if turn == 0 else "") + text)  # the prefill opens turn 0's tag
        response += text
        if parsed.kind == TurnKind.ANSWER:
            return parsed.answer
        if parsed.kind == TurnKind.NONE or turn == session.max_turns - 1:
            return None  # no tag: the model ended (or ran out of tokens); the scorer finds no answer
        response += await observation(session, parsed)
    return None


async def write_turn(client: AsyncOpenAI, session, messages: list[dict], response: str):
    """The chat completion of the model's next turn: it continues ``response``, the answer so far after
    ``messages``, until a closing tag."""
    return await client.chat.completions.create(
        model=session.model, messages=[*messages, {"role": "assistant", "content": response}],
        stop=list(PROTOCOL.stop_strings), extra_body=CONTINUE,
    )


async def observation(session, parsed) -> str:
    """What the answer goes on with after a turn that neither answered nor ended: the search result of a
    `<search>`, or the error of a malformed turn."""
    if parsed.kind == TurnKind.TOOL_CALL:
        result = await session.tools.call("search", parsed.call.query)
        if result.ok:
            return PROTOCOL.observation(result.documents)
        return PROTOCOL.error_observation(f"search failed: {result.error}")
    return PROTOCOL.error_observation(parsed.error)
