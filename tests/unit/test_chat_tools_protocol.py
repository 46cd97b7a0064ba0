"""The chat_tools protocol: parsing native tool calls, the tools' schemas, observations derived from the chat
template (token-exact against a full re-render, seams included), typed arguments reaching the built-in tools, and
the agent loop running several calls per turn (scripted engine, fake tools: no vLLM engine, no server)."""

import asyncio
import copy
import json
import random
from types import SimpleNamespace

import pytest

from rlsearch.config import RolloutConfig
from rlsearch.rollout import AgentLoop, PromptItem, Trajectory, Turn
from rlsearch.tools import Document, ErrorKind, ToolCall, ToolRegistry, ToolSetupError, ToolSpec, TurnKind
from rlsearch.tools.base import PerCallTool, query_parameters
from rlsearch.tools.clients.registry import with_query
from rlsearch.tools.protocols import make_protocol
from rlsearch.tools.protocols.chat_tools import (
    KNOWN_SEAMS,
    openai_tool_schemas,
    parse_tool_calls,
    template_mismatches,
)
from rlsearch.trainer.metrics import trajectory_metrics
from tests.concurrency import InFlight

SEARCH_PARAMETERS = {
    "type": "object",
    "properties": {"query": {"type": "string"}, "topk": {"type": "integer"}},
    "required": ["query"],
}
SPECS = [ToolSpec("search", "search the collection", SEARCH_PARAMETERS), ToolSpec("browse", "read a page")]
IM_END = 151645  # the Qwen2 tokenizer's <|im_end|>


@pytest.fixture(scope="module")
def protocol(tokenizer):
    return make_protocol("chat_tools", SPECS, tokenizer=tokenizer)


def block(name: str, arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# --- parsing -------------------------------------------------------------------------------------------------------


def test_one_call() -> None:
    assert parse_tool_calls(block("search", {"query": "capital of France"})) == (
        [ToolCall("search", "", arguments={"query": "capital of France"})], None
    )


def test_two_calls_in_order_with_text_around_them() -> None:
    text = f"I search twice.\n{block('search', {'query': 'a'})}\nthen\n{block('browse', {'url': 'https://x.org'})}\nok"
    calls, error = parse_tool_calls(text)
    assert error is None
    assert [(call.name, call.query, call.arguments) for call in calls] == [
        ("search", "", {"query": "a"}), ("browse", "", {"url": "https://x.org"}),
    ]


def test_typed_arguments_pass_through_unchanged() -> None:
    arguments = {"query": "q", "topk": 5, "exact": True, "weight": 0.5, "filters": {"years": [2019, 2020], "x": None}}
    (call,), error = parse_tool_calls(block("search", arguments))
    assert error is None and call.arguments == arguments
    assert type(call.arguments["topk"]) is int and call.arguments["exact"] is True


def test_arguments_as_a_json_string_and_absent_arguments() -> None:
    text = '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call>'
    text += '<tool_call>{"name": "t"}</tool_call>'
    calls = [ToolCall("search", "", arguments={"query": "x"}), ToolCall("t", "", arguments={})]
    assert parse_tool_calls(text) == (calls, None)


@pytest.mark.parametrize(
    ("text", "parsed", "error"),
    [
        ('<tool_call>\n{"name": "search", "arguments": {"query": "x"}\n</tool_call>', 0,
         "tool call 1: invalid JSON (Expecting ',' delimiter: line 3 column 1 (char 48))"),
        ('<tool_call>{"arguments": {"query": "x"}}</tool_call>', 0, 'tool call 1: missing "name" (the tool to call)'),
        ('<tool_call>{"name": "  ", "arguments": {}}</tool_call>', 0, 'tool call 1: missing "name" (the tool to call)'),
        ('<tool_call>{"name": 7}</tool_call>', 0, 'tool call 1: missing "name" (the tool to call)'),
        ('<tool_call>["search"]</tool_call>', 0,
         'tool call 1: expected a JSON object {"name": ..., "arguments": {...}}'),
        ('<tool_call>{"name": "search", "arguments": [1]}</tool_call>', 0,
         "tool call 1: the \"arguments\" of 'search' must be a JSON object"),
        (block("search", {"query": "a"}) + '<tool_call>{"name": "search", "arguments": {"query": "b"}', 1,
         "tool call 2: <tool_call> is never closed with </tool_call>"),
    ],
    ids=["bad-json", "no-name", "blank-name", "name-not-text", "not-an-object", "arguments-not-an-object", "unclosed"],
)
def test_malformed_calls_are_errors_that_name_the_block(text: str, parsed: int, error: str) -> None:
    calls, message = parse_tool_calls(text)
    assert (len(calls), message) == (parsed, error)


def test_text_without_calls() -> None:
    assert parse_tool_calls("<answer> Paris </answer> and a stray </tool_call>") == ([], None)


def test_openai_tool_schemas() -> None:
    assert openai_tool_schemas(SPECS) == [
        {"type": "function", "function": {"name": "search", "description": "search the collection",
                                          "parameters": SEARCH_PARAMETERS}},
        {"type": "function", "function": {"name": "browse", "description": "read a page",
                                          "parameters": query_parameters()}},
    ]


@pytest.mark.parametrize(
    ("text", "finish_reason", "kind", "num_calls"),
    [
        (block("search", {"query": "a"}) + block("search", {"query": "b"}), "stop", TurnKind.TOOL_CALL, 2),
        ("<answer> Paris </answer>", "stop", TurnKind.ANSWER, 0),
        ("<answer> Par", "length", TurnKind.NONE, 0),
        (block("search", {"query": "a"}) + " and then I kept wri", "length", TurnKind.TOOL_CALL, 1),
        ('<tool_call>\n{"name": "search", "argum', "length", TurnKind.INVALID_CALL, 0),
    ],
    ids=["ended-with-calls", "ended-without-calls", "cut-without-calls", "cut-after-a-call", "cut-inside-a-call"],
)
def test_turn_actions(protocol, text: str, finish_reason: str, kind: TurnKind, num_calls: int) -> None:
    action = protocol.parse_completion(text, finish_reason, None)
    assert (action.kind, len(action.calls)) == (kind, num_calls)
    assert (action.error_kind is ErrorKind.UNPARSEABLE) == (kind is TurnKind.INVALID_CALL)


# --- rendering from the chat template ------------------------------------------------------------------------------


def test_prompt_lists_the_tools_from_their_schemas(protocol, tokenizer) -> None:
    messages = [{"role": "system", "content": protocol.system_prompt()}, {"role": "user", "content": "Who?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **protocol.template_kwargs)
    assert text.startswith("<|im_start|>system\nYou are a research assistant")
    for schema in openai_tool_schemas(SPECS):
        assert f"\n{json.dumps(schema)}\n" in text
    assert text.endswith("<|im_start|>user\nWho?<|im_end|>\n<|im_start|>assistant\n")
    assert "<answer>" in protocol.system_prompt()


def test_observation_is_the_template_text_after_the_turn_with_the_seam(protocol) -> None:
    assert (protocol.end_of_turn, protocol.end_of_turn_id, protocol.stop_token_ids) == ("<|im_end|>", IM_END, (IM_END,))
    after_turn = ("\n<|im_start|>user\n<tool_response>\nfirst\n</tool_response>\n<tool_response>\nsecond\n"
                  "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert protocol.turn_observation(["first", "second"], IM_END) == after_turn
    # a turn cut before its end-of-turn token: the observation closes it first
    assert protocol.turn_observation(["first", "second"], 1234) == "<|im_end|>" + after_turn


def test_observation_follows_the_template_not_fixed_strings(tokenizer) -> None:
    double_seam = copy.deepcopy(tokenizer)
    double_seam.chat_template = tokenizer.chat_template.replace("<|im_end|>\n", "<|im_end|>\n\n")
    protocol = make_protocol("chat_tools", SPECS, tokenizer=double_seam)
    assert protocol.turn_observation(["x"], IM_END).startswith("\n\n<|im_start|>user\n<tool_response>\nx\n")
    assert protocol.final_turn_close() == "<|im_end|>\n\n"


def test_a_template_without_tool_calling_or_no_tokenizer_is_a_setup_error(tokenizer) -> None:
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    with pytest.raises(ToolSetupError, match="needs a chat template with Qwen-style tool calling"):
        make_protocol("chat_tools", SPECS, tokenizer=plain)
    with pytest.raises(ToolSetupError, match="it needs its tokenizer"):
        make_protocol("chat_tools", SPECS)


# --- token-exactness against a full re-render ----------------------------------------------------------------------

# pieces that stress byte-level BPE at the edges of tool output: whitespace runs, newlines, combining marks, emoji,
# multi-byte scripts, contractions, digits, tag look-alikes
PIECES = ["\n", "\n\n", " ", "   ", "\t", "\r\n", " \n", "\n ", "é", "e\u0301", "中文", "日本語", "😀", "👩\u200d💻",
          "'s", "'ll", "123", "4.5", "</tool_response>", "<tool_response>", "</tool_call>", "{", "}", '"', "\\", "the",
          " the", "…", "\u200b", "ﬁ", "<", ">", "&amp;", "Ġ", "\x0b", "ーション"]


def random_output(rng: random.Random) -> str:
    parts = [rng.choice(PIECES) if rng.random() < 0.6 else chr(rng.choice([rng.randint(0x20, 0x2FF),
                                                                            rng.randint(0x4E00, 0x9FFF)]))
             for _ in range(rng.randint(0, 30))]
    return rng.choice(["", "\n", "\n\n", " "]) + "".join(parts) + rng.choice(["", "\n", " \n", "\n\n"])


def simulated_trajectory(protocol, tokenizer, rng: random.Random, drop_seam: bool = False):
    """A conversation built the way the agent loop builds it: sampled ids (here the text's own tokenisation, ended
    by <|im_end|> or cut before it), then each observation's text tokenised alone. ``drop_seam``: the observations
    after an ended turn lose their leading newline (the bug of verl #6501); returns where they lost it."""
    prompt_messages = [{"role": "system", "content": protocol.system_prompt()},
                       {"role": "user", "content": protocol.instruction("Who founded Velmora?")}]
    prompt = tokenizer.apply_chat_template(prompt_messages, tokenize=False, add_generation_prompt=True,
                                           **protocol.template_kwargs)
    trajectory = Trajectory("q", 0, 0, tokenizer.encode(prompt, add_special_tokens=False))
    dropped = []
    turns = [[random_output(rng) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 3))]
    for outputs in [*turns, None]:
        text = ("<answer> Mebri </answer>" if outputs is None
                else "".join(block("search", {"query": random_output(rng)}) for _ in outputs))
        sampled = tokenizer.encode(text, add_special_tokens=False) + ([IM_END] if rng.random() < 0.5 else [])
        trajectory.append_model_tokens(sampled, [-1.0] * len(sampled))
        turn = Turn(text=text, num_tokens=len(sampled), kind="answer" if outputs is None else "tool_call")
        trajectory.turns.append(turn)
        if outputs is not None:
            turn.tool_outputs = outputs
            turn.observation = observation = protocol.turn_observation(outputs, sampled[-1])
            if drop_seam and sampled[-1] == IM_END:
                dropped.append(len(trajectory.token_ids))
                observation = observation.removeprefix("\n")
            trajectory.append_observation_tokens(tokenizer.encode(observation, add_special_tokens=False))
    return trajectory, prompt_messages, dropped


def test_observation_ids_equal_a_full_rerender_over_random_tool_outputs(protocol, tokenizer) -> None:
    rng = random.Random(21)
    for _ in range(200):
        trajectory, prompt_messages, _ = simulated_trajectory(protocol, tokenizer, rng)
        mismatches = template_mismatches(protocol, prompt_messages, trajectory)
        # the only difference: the template closes the last turn after the point where generation stopped
        ended = trajectory.response_ids[-1] == IM_END
        assert [(m.seam, m.position, m.text, m.rendered_text) for m in mismatches] == [
            ("end", len(trajectory.token_ids), "", "\n" if ended else "<|im_end|>\n")
        ]


def test_the_checker_finds_a_dropped_seam_newline(protocol, tokenizer) -> None:
    rng = random.Random(6501)
    found = 0
    for _ in range(20):
        trajectory, prompt_messages, dropped = simulated_trajectory(protocol, tokenizer, rng, drop_seam=True)
        unexplained = [m for m in template_mismatches(protocol, prompt_messages, trajectory) if m.seam is None]
        assert [(m.position, m.text, m.rendered_text) for m in unexplained] == [(p, "", "\n") for p in dropped]
        found += len(unexplained)
    assert found >= 10


def test_the_checker_names_the_sampled_and_turn_start_seams(protocol, tokenizer) -> None:
    prompt_messages = [{"role": "user", "content": "Who?"}]
    prompt = tokenizer.apply_chat_template(prompt_messages, tokenize=False, add_generation_prompt=True,
                                           **protocol.template_kwargs)
    trajectory = Trajectory("q", 0, 0, tokenizer.encode(prompt, add_special_tokens=False))
    # the policy may sample "\n\n" after the header's "\n" (re-encoded: one "\n\n\n") and spell a word letter by
    # letter (re-encoded: one token)
    text = "\n\n<answer> Paris </answer>"
    sampled = [*tokenizer.encode("\n\n<answer>"), *(tokenizer.encode(c)[0] for c in " Paris"),
               *tokenizer.encode(" </answer>"), IM_END]
    assert tokenizer.decode(sampled[:-1]) == text
    trajectory.append_model_tokens(sampled, [-1.0] * len(sampled))
    trajectory.turns.append(Turn(text=text, num_tokens=len(sampled), kind="answer"))
    mismatches = template_mismatches(protocol, prompt_messages, trajectory)
    assert [(m.seam, m.text, m.rendered_text) for m in mismatches] == [
        ("turn_start", "\n\n\n", "\n\n\n"), ("sampled", " Paris", " Paris"), ("end", "", "\n"),
    ]
    assert set(KNOWN_SEAMS) == {"sampled", "turn_start", "end"}


# --- typed arguments reach the built-in tools ----------------------------------------------------------------------


def test_native_arguments_become_query_and_attributes() -> None:
    call = ToolCall("search", "", arguments={"topk": 3, "query": "river", "exact": True, "filters": {"y": [1]}})
    normal = with_query(call, SEARCH_PARAMETERS)
    assert (normal.query, normal.attrs, normal.arguments) == (
        "river", {"topk": "3", "exact": "true", "filters": '{"y": [1]}'}, call.arguments
    )
    url_schema = {"type": "object", "properties": {"k": {"type": "integer"}, "url": {"type": "string"}}}
    assert with_query(ToolCall("browse", "", arguments={"url": "https://x.org", "k": 2}), url_schema).query == (
        "https://x.org"
    )
    tag_call = ToolCall("search", "river", {"topk": "2"})
    assert with_query(tag_call, SEARCH_PARAMETERS) is tag_call
    assert with_query(ToolCall("search", "", arguments={"topk": 3}), SEARCH_PARAMETERS).query == ""


class QueryTool(PerCallTool):
    """Answers ``name: query``; keeps the calls it got, each made inside ``in_flight``."""

    def __init__(self, name: str, in_flight: InFlight | None = None) -> None:
        super().__init__(ToolSpec(name, f"the {name} tool", SEARCH_PARAMETERS), max_concurrency=4)
        self.in_flight = in_flight or InFlight()
        self.calls: list[ToolCall] = []

    def call(self, call: ToolCall) -> list[Document]:
        self.calls.append(call)
        with self.in_flight:
            return [Document(text=f"{self.spec.name}: {call.query} {sorted(call.attrs.items())}", title=call.query)]


def test_registry_runs_native_calls_through_query_tools() -> None:
    tool = QueryTool("search")
    registry = ToolRegistry([tool])
    (result,) = registry.run([ToolCall("search", "", arguments={"query": "river", "topk": 2})])
    assert result.ok and result.documents[0].text == "search: river [('topk', '2')]"
    assert tool.calls == [ToolCall("search", "river", {"topk": "2"}, {"query": "river", "topk": 2})]
    registry.close()


# --- the agent loop with several calls per turn ---------------------------------------------------------------------


class ScriptedChatEngine:
    """Replays fixed turns per prompt as vLLM returns them for chat_tools: the text without <|im_end|>, the ids with it
    when the turn ended (finish_reason stop), without it when cut at the token limit (finish_reason length)."""

    weight_version = 0

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.scripts: list[tuple[list[int], list[tuple[str, bool]]]] = []  # (prompt ids, turns)

    async def generate(self, prompts: list[list[int]], sampling_params: list) -> list:
        assert [params.stop_token_ids for params in sampling_params] == [[IM_END]] * len(prompts)
        return [self._next_turn(ids) for ids in prompts]

    def _next_turn(self, ids: list[int]):
        text, ended = next(turns for prompt, turns in self.scripts if ids[: len(prompt)] == prompt).pop(0)
        token_ids = self.tokenizer.encode(text, add_special_tokens=False) + ([IM_END] if ended else [])
        completion = SimpleNamespace(
            text=text, token_ids=token_ids, logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in token_ids],
            finish_reason="stop" if ended else "length", stop_reason=None,
        )
        return SimpleNamespace(outputs=[completion], num_cached_tokens=0)


class BatchCountingRegistry(ToolRegistry):
    def __init__(self, tools) -> None:
        super().__init__(tools)
        self.batch_sizes: list[int] = []

    def run(self, calls):
        self.batch_sizes.append(len(calls))
        return super().run(calls)


def run_scripted(tokenizer, registry: ToolRegistry, config: RolloutConfig, scripts: dict[str, list[tuple[str, bool]]]):
    """The agent loop over one trajectory per question of ``scripts``, each replaying its turns."""
    protocol = make_protocol("chat_tools", registry.specs, tokenizer=tokenizer)
    engine = ScriptedChatEngine(tokenizer)
    loop = AgentLoop(engine, protocol, registry, config, seed=1)
    engine.scripts = [(loop.prompt_ids(question), list(turns)) for question, turns in scripts.items()]
    items = [PromptItem(f"q{index}", question, index, 0) for index, question in enumerate(scripts)]
    return loop, asyncio.run(loop.run(items, 1))


def test_agent_loop_runs_the_calls_of_a_turn_at_once_in_call_order(tokenizer) -> None:
    both_at_once = InFlight(meet=2)  # run one after the other, the first call would end at the hang guard
    registry = ToolRegistry([QueryTool("search", both_at_once), QueryTool("browse", both_at_once)])
    two_calls = block("search", {"query": "alpha"}) + "\n" + block("browse", {"query": "page"})
    _, (trajectory,) = run_scripted(tokenizer, registry, RolloutConfig(protocol="chat_tools"), {
        "Who founded Velmora?": [(two_calls, True), ("<answer> Mebri </answer>", True)],
    })
    assert trajectory.turns[0].tool_outputs == ["[1] alpha\nsearch: alpha []", "[1] page\nbrowse: page []"]
    assert (both_at_once.calls, both_at_once.most) == (2, 2)
    registry.close()


@pytest.mark.parametrize(("agent_loop", "batch_sizes"), [("per_sample", [2, 3]), ("turn_barrier", [5])])
def test_both_schedules_keep_each_trajectory_s_calls_in_order(tokenizer, agent_loop: str, batch_sizes) -> None:
    registry = BatchCountingRegistry([QueryTool("search"), QueryTool("browse")])
    scripts = {
        question: [("".join(block(tool, {"query": f"{question[:3]}{i}"}) for i, tool in enumerate(tools)), True),
                   ("<answer> x </answer>", True)]
        for question, tools in (("Who?", ("search", "browse")), ("Why?", ("browse", "search", "search")))
    }
    _, trajectories = run_scripted(tokenizer, registry, RolloutConfig(protocol="chat_tools", agent_loop=agent_loop),
                                   scripts)
    assert [turn.tool_outputs for t in trajectories for turn in t.turns[:1]] == [
        ["[1] Who0\nsearch: Who0 []", "[1] Who1\nbrowse: Who1 []"],
        ["[1] Why0\nbrowse: Why0 []", "[1] Why1\nsearch: Why1 []", "[1] Why2\nsearch: Why2 []"],
    ]
    assert sorted(registry.batch_sizes) == batch_sizes
    assert [t.finish_reason for t in trajectories] == ["answer", "answer"]
    registry.close()


def test_agent_loop_limits_errors_and_cut_turns_with_several_calls(tokenizer) -> None:
    search, browse = QueryTool("search"), QueryTool("browse")
    registry = ToolRegistry([search, browse])
    config = RolloutConfig(protocol="chat_tools", max_turns=6, max_response_tokens=4000, max_tool_calls=5,
                           max_calls_per_tool={"browse": 1})
    cut_turn = block("search", {"query": "delta"}) + " and I kept writing"
    loop, (trajectory,) = run_scripted(tokenizer, registry, config, {"Who founded Velmora?": [
        (block("search", {"query": "alpha", "topk": 2}) + "\n" + block("browse", {"query": "page"}), True),
        (cut_turn, False),  # cut at the token limit after a complete call
        (block("browse", {"query": "p2"}) + block("search", {"query": "beta"}) + block("google", {"query": "x"})
         + block("search", {"query": "c"}), True),  # over the browse limit, ok, unknown tool, over max_tool_calls
        ('<tool_call>\n{"name": "search", "arguments": {"query": "x"}\n</tool_call>', True),
        ("<answer> Mebri </answer>", True),
    ]})

    assert trajectory.finish_reason == "answer"
    assert [turn.kind for turn in trajectory.turns] == ["tool_call"] * 3 + ["invalid_call", "answer"]
    assert [[call.error_kind for call in turn.tool_calls] for turn in trajectory.turns] == [
        [None, None], [None], ["over_limit", None, "unknown_tool", "over_limit"], [], []]
    assert [turn.error_kind for turn in trajectory.turns] == [None, None, "over_limit", "unparseable", None]
    assert trajectory.turns[0].tool_outputs == ["[1] alpha\nsearch: alpha [('topk', '2')]", "[1] page\nbrowse: page []"]
    third = trajectory.turns[2]
    assert third.tool_outputs == [
        "Error: the limit of 1 calls to 'browse' is reached; use another tool or answer",
        "[1] beta\nsearch: beta []",
        "Error: unknown tool 'google'; available tools: search, browse",
        "Error: the limit of 5 tool calls is reached; answer with what you know",
    ]
    assert third.observation == (
        "\n<|im_start|>user\n" + "\n".join(f"<tool_response>\n{o}\n</tool_response>" for o in third.tool_outputs)
        + "<|im_end|>\n<|im_start|>assistant\n")
    assert trajectory.turns[3].tool_outputs[0].startswith("Error: tool call 1: invalid JSON (Expecting ','")
    assert [call.query for call in search.calls] == ["alpha", "delta", "beta"]
    assert [call.query for call in browse.calls] == ["page"]

    # sampled ids mask 1; each observation is its text's tokenisation, mask 0; the cut turn's starts with <|im_end|>
    position, observation_starts = 0, []
    for turn in trajectory.turns:
        assert trajectory.loss_mask[position : position + turn.num_tokens] == [1] * turn.num_tokens
        position += turn.num_tokens
        if turn.observation is not None:
            observation_ids = tokenizer.encode(turn.observation, add_special_tokens=False)
            assert trajectory.response_ids[position : position + len(observation_ids)] == observation_ids
            assert trajectory.loss_mask[position : position + len(observation_ids)] == [0] * len(observation_ids)
            observation_starts.append(position)
            position += len(observation_ids)
    assert position == len(trajectory.response_ids)
    assert [trajectory.response_ids[start] for start in observation_starts] == [198, IM_END, 198, 198]  # "\n"
    assert trajectory.turns[1].text == cut_turn
    mismatches = template_mismatches(loop.protocol, loop.prompt_messages("Who founded Velmora?"), trajectory)
    assert [m.seam for m in mismatches] == ["end"]

    metrics = trajectory_metrics([trajectory])
    assert (metrics["rollout/tool_calls/search"], metrics["rollout/tool_calls/browse"]) == (3.0, 1.0)
    assert (metrics["rollout/tool_calls_mean"], metrics["rollout/invalid_calls_mean"]) == (7.0, 1.0)
    assert {kind.value: metrics[f"rollout/errors/{kind.value}"] for kind in ErrorKind} == {
        "unparseable": 1.0, "empty_query": 0.0, "unknown_tool": 1.0, "over_limit": 2.0, "timeout": 0.0,
        "tool_error": 0.0, "not_run": 0.0,
    }
    registry.close()


def test_calls_of_a_turn_cut_by_max_turns_are_recorded_as_not_run(tokenizer) -> None:
    search = QueryTool("search")
    registry = ToolRegistry([search])
    two_calls = block("search", {"query": "beta"}) + block("search", {"query": "gamma"})
    _, (trajectory,) = run_scripted(tokenizer, registry, RolloutConfig(protocol="chat_tools", max_turns=2), {
        "Who founded Velmora?": [(block("search", {"query": "alpha"}), True), (two_calls, True)],
    })
    assert trajectory.finish_reason == "max_turns" and [call.query for call in search.calls] == ["alpha"]
    last = trajectory.turns[-1]
    assert [(call.ok, call.error_kind, call.error) for call in last.tool_calls] == [
        (False, "not_run", "not run: the trajectory was cut after this turn (max_turns)")] * 2
    assert last.error_kind is None and last.observation is None
    metrics = trajectory_metrics([trajectory])
    assert (metrics["rollout/errors/not_run"], metrics["rollout/tool_errors"]) == (2.0, 0.0)
    assert (metrics["rollout/tool_calls/search"], metrics["rollout/tool_calls_mean"]) == (1.0, 3.0)
    registry.close()
