"""A DR Tulu-style research agent with several tools, written on the `openai` client's native tool calling (use
it with rollout.agent=examples.agents.multi_tool:agent and tools such as search, browse or MCP servers).

Each turn the model sees every configured tool as a JSON-schema function. The tool calls it writes in a turn run
concurrently (`session.tools.run`), and their results go back as tool messages, in call order. The conversation
only grows, so the endpoint continues each call from the ids it sampled: the trainer gets token-exact turns.
A reply with no tool call is the final answer. The `<answer>` block is taken if there is one, else the whole reply.
"""

import json

from openai import AsyncOpenAI

from rlsearch.reward import extract_answer
from rlsearch.tools import ToolCall, ToolResult

SYSTEM = (
    "Answer the question by researching it with the tools. Call as many as you need, several at once if they are "
    "independent. When you know the answer, reply without a tool call and put it in <answer> </answer>."
)


async def agent(session, example) -> str | None:
    client: AsyncOpenAI = session.openai()  # the official client, pointed at this trajectory's endpoint
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": example.question}]
    for _ in range(session.max_turns):
        chat = await client.chat.completions.create(
            model=session.model, messages=messages, tools=session.tools.openai_schemas()
        )
        reply = chat.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return extract_answer(reply.content or "") or reply.content
        calls = [ToolCall(call.function.name, "", arguments=json.loads(call.function.arguments))
                 for call in reply.tool_calls]
        results = await session.tools.run(calls)  # concurrently; results in call order
        for call, result in zip(reply.tool_calls, results):
            messages.append({"role": "tool", "tool_call_id": call.id, "content": render(result)})
    return None


def render(result: ToolResult) -> str:
    if not result.ok:
        return f"Error: {result.error}"
    documents = [f"[{doc.display_id}] {doc.title}\n{doc.text}".strip() for doc in result.documents]
    return "\n\n".join(documents) or "No results."
