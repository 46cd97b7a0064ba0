"""Session token accounting with the real Qwen tokenizer: chat calls that extend each other merge into the ids a full
re-render gives, for random tool outputs (BPE seams, newlines, unicode), with the `<|im_end|>` seam explicit."""

from __future__ import annotations

import random

import pytest

from rlsearch.rollout.session.render import ChatRenderer, RequestError
from rlsearch.rollout.session.tokens import SessionTokens

PIECES = ["\n", "\n\n", " ", "  ", "\t", "Doc", " 1", "(Title:", "é", "日本", "🙂", "<", ">", "</", "tool", "_", "{",
          "\"q\":", "'s", "123", "...", "\u00a0", "ing", " the", "\r\n"]
TOOLS = [{"type": "function", "function": {"name": "search", "description": "search the corpus",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                          "required": ["query"]}}}]


def random_text(rng: random.Random, longest: int = 12) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, longest)))


def model_text(rng: random.Random) -> str:
    """Assistant text that does not start with whitespace. A reply that does is a seam no merge can hide: the
    model sampled its first newline after the prompt's, while a re-render merges the two into one token."""
    return random_text(rng).lstrip() or "x"


def sample(session: SessionTokens, renderer: ChatRenderer, messages: list[dict], reply: dict, tools=None) -> None:
    """One chat call whose model output is the canonical tokenisation of ``reply`` (as a re-render would give it)."""

    def render(conversation, generation_prompt):
        return renderer.render(conversation, generation_prompt, tools)

    text = render(messages, True)
    prompt = session.plan_text(text, messages, render)
    closed = renderer.render([*messages, reply], False, tools)
    sampled = session.encode(closed[len(text):].removesuffix("\n"))  # the turn as sampled, up to <|im_end|>
    session.record(prompt, text, sampled, [-1.0] * len(sampled), [*messages, reply])


def test_random_tool_outputs_merge_into_the_full_rerender(tokenizer):
    rng = random.Random(0)
    renderer = ChatRenderer(tokenizer)
    for case in range(60):
        tools = TOOLS if case % 2 else None
        session = SessionTokens(tokenizer, "<|im_end|>")
        messages = [{"role": "user", "content": random_text(rng)}]
        for _ in range(rng.randint(1, 3)):
            reply = {"role": "assistant", "content": model_text(rng)}
            if tools and rng.random() < 0.7:
                reply["tool_calls"] = [{"type": "function", "function": {"name": "search", "arguments": {
                    "query": random_text(rng, 4)}}} for _ in range(rng.randint(1, 2))]
            sample(session, renderer, messages, reply, tools)
            messages = [*messages, reply]
            messages += [{"role": "tool", "content": random_text(rng, 20)} for _ in range(rng.randint(1, 2))]
        final = {"role": "assistant", "content": model_text(rng)}
        sample(session, renderer, messages, final, tools)
        assert len(session.segments) == 1
        segment = session.current
        full = renderer.render([*messages, final], False, tools).removesuffix("\n")
        assert segment.ids == tokenizer.encode(full, add_special_tokens=False), case
        # exactly the sampled tokens train; the seam after every <|im_end|> the model wrote is an inserted token
        end_of_turn, newline = session.end_of_turn_id, tokenizer.encode("\n")[0]
        for position, token in enumerate(segment.ids[:-1]):
            if token == end_of_turn and segment.loss_mask[position]:
                assert segment.ids[position + 1] == newline and segment.loss_mask[position + 1] == 0


def test_a_dropped_seam_newline_would_not_match_the_rerender(tokenizer):
    renderer = ChatRenderer(tokenizer)
    messages = [{"role": "user", "content": "q"}]
    reply = {"role": "assistant", "content": "a"}
    after = [*messages, reply, {"role": "tool", "content": "r"}]
    session = SessionTokens(tokenizer, "<|im_end|>")
    sample(session, renderer, messages, reply)
    prompt = session.plan_text(renderer.render(after, True), after, lambda m, g: renderer.render(m, g))
    full = tokenizer.encode(renderer.render(after, True), add_special_tokens=False)
    assert prompt.extends and prompt.ids == full
    assert tokenizer.decode(prompt.inserted).startswith("\n<|im_start|>user\n<tool_response>")
    without_seam = prompt.ids[: len(prompt.ids) - len(prompt.inserted)] + prompt.inserted[1:]
    assert without_seam != full  # the checker's comparison catches a seam that went missing (verl #6501)


def test_a_turn_cut_before_its_end_gets_the_end_of_turn_inserted(tokenizer):
    renderer = ChatRenderer(tokenizer)
    messages = [{"role": "user", "content": "q"}]
    session = SessionTokens(tokenizer, "<|im_end|>")
    text = renderer.render(messages, True)
    prompt = session.plan_text(text, messages, lambda m, g: renderer.render(m, g))
    cut = tokenizer.encode("an unfinished", add_special_tokens=False)  # stopped by the token limit
    session.record(prompt, text, cut, [-1.0] * len(cut), [*messages, {"role": "assistant", "content": "an unfinished"}])
    after = [*messages, {"role": "assistant", "content": "an unfinished"}, {"role": "user", "content": "go on"}]
    planned = session.plan_text(renderer.render(after, True), after, lambda m, g: renderer.render(m, g))
    assert planned.extends
    assert tokenizer.decode(planned.inserted).startswith("<|im_end|>\n<|im_start|>user\ngo on")
    assert planned.ids == tokenizer.encode(renderer.render(after, True), add_special_tokens=False)


def test_rewritten_history_starts_a_new_segment_and_ids_extend_by_prefix(tokenizer):
    renderer = ChatRenderer(tokenizer)
    session = SessionTokens(tokenizer, "<|im_end|>")
    messages = [{"role": "user", "content": "first question"}]
    sample(session, renderer, messages, {"role": "assistant", "content": "an answer"})
    edited = [{"role": "user", "content": "an edited question"}]
    assert not session.plan_text(renderer.render(edited, True), edited, lambda m, g: renderer.render(m, g)).extends
    held = session.current.ids
    assert session.plan_ids(held + [11, 12]).inserted == [11, 12]
    assert not session.plan_ids(held[:-1] + [11]).extends


def test_continue_final_message_leaves_the_assistant_turn_open(tokenizer):
    renderer = ChatRenderer(tokenizer)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<search>"}]
    text = renderer.render(messages, continue_final_message=True)
    assert text == renderer.render(messages[:1], True) + "<search>"
    empty = renderer.render([messages[0], {"role": "assistant", "content": ""}], continue_final_message=True)
    assert empty == renderer.render(messages[:1], True)
    with pytest.raises(RequestError, match="last message to be the assistant's"):
        renderer.render(messages[:1], continue_final_message=True)
