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
        chat = await client.chat.completions.create(
            model=session.model, messages=[*example.prompt_messages, {"role": "assistant", "content": response}],
            stop=list(PROTOCOL.stop_strings), extra_body=CONTINUE,
        )
        text = chat.choices[0].message.content
        parsed = PROTOCOL.parse_turn((response if turn == 0 else "") + text)  # the prefill opens turn 0's tag
        response += text
        if parsed.kind == TurnKind.ANSWER:
            return parsed.answer
        if parsed.kind == TurnKind.NONE or turn == session.max_turns - 1:
            return None  # no tag: the model ended (or ran out of tokens); the scorer finds no answer
        if parsed.kind == TurnKind.TOOL_CALL:
            result = await session.tools.call("search", parsed.call.query)
            ok = result.ok
            response += PROTOCOL.observation(result.documents) if ok else PROTOCOL.error_observation(
                f"search failed: {result.error}"
            )
        else:
            response += PROTOCOL.error_observation(parsed.error)
    return None
