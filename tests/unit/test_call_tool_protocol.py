"""The <call_tool> protocol (DR Tulu's unified format): parsing adversarial turns, rendering, prompts."""

import pytest

from rlsearch.tools import CallToolProtocol, Document, ErrorKind, ParsedTurn, ToolCall, ToolSpec, TurnKind
from rlsearch.tools.protocols import PromptTemplate

TOOLS = [ToolSpec("search", "search the collection"), ToolSpec("browse", "read a page")]
PROTOCOL = CallToolProtocol(TOOLS)


def parse(text: str) -> ParsedTurn:
    return PROTOCOL.parse_turn(text)


def call(name: str, query: str, **attrs: str) -> ParsedTurn:
    return ParsedTurn(TurnKind.TOOL_CALL, call=ToolCall(name, query, attrs))


def test_call_tool_plain_call() -> None:
    text = '<think>look it up</think>\n<call_tool name="search">mayor of Velmora</call_tool>'
    assert parse(text) == call("search", "mayor of Velmora")


def test_call_tool_attributes_in_both_quote_styles_and_bare() -> None:
    text = """<call_tool name='search' topk="5" lang=en note='he said "hi"' q2="it's">river towns</call_tool>"""
    assert parse(text) == call("search", "river towns", topk="5", lang="en", note='he said "hi"', q2="it's")


def test_call_tool_attribute_with_angle_bracket_inside_quotes() -> None:
    assert parse('<call_tool name="search" filter="a>b">x</call_tool>') == call("search", "x", filter="a>b")


def test_call_tool_two_calls_in_one_turn_runs_the_first() -> None:
    text = '<call_tool name="search">first</call_tool><call_tool name="browse">second</call_tool>'
    assert parse(text) == call("search", "first")


def test_call_tool_nested_opening_tags_use_the_innermost() -> None:
    text = '<call_tool name="search">outer <call_tool name="browse">local://corpus/7</call_tool></call_tool>'
    assert parse(text) == call("browse", "local://corpus/7")


def test_call_tool_unclosed_tag_is_not_a_call() -> None:
    assert parse('<call_tool name="search">who built the Geler') == ParsedTurn(TurnKind.NONE)
    # a closing tag cut short (generation ended inside it) is not a call either
    assert parse('<call_tool name="search">who</call_to') == ParsedTurn(TurnKind.NONE)


def test_call_tool_tags_split_across_tokens_parse_like_whole_text() -> None:
    pieces = ["<call", "_tool na", 'me="sea', 'rch">Ge', "ler</ca", "ll_tool", ">\n<tool_"]
    assert parse("".join(pieces)) == call("search", "Geler")


def test_call_tool_unicode_name_and_query() -> None:
    text = '<call_tool name="search" lang="中文">Þórr 北京 café — naïve 🚀</call_tool>'
    assert parse(text) == call("search", "Þórr 北京 café — naïve 🚀", lang="中文")


def test_call_tool_word_prefix_is_not_an_opening_tag() -> None:
    text = '<call_toolbox name="x">no</call_tool>'
    assert parse(text).error_kind is ErrorKind.UNPARSEABLE
    text = '<call_toolbox> then <call_tool name="search">yes</call_tool>'
    assert parse(text) == call("search", "yes")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("just text</call_tool>", "missing opening tag"),
        ('<call_tool>q</call_tool>', 'no name="TOOL" attribute'),
        ('<call_tool name="">q</call_tool>', 'no name="TOOL" attribute'),
        ('<call_tool name="search" name="browse">q</call_tool>', "attribute 'name' is given twice"),
        ('<call_tool name="search q</call_tool>', "malformed <call_tool tag"),
        ('<call_tool name="search" topk>q</call_tool>', "malformed <call_tool tag"),
        ('<call_tool name=search topk=5 q</call_tool>', "malformed <call_tool tag"),
    ],
)
def test_call_tool_unparseable_calls_say_why(text: str, message: str) -> None:
    turn = parse(text)
    assert (turn.kind, turn.error_kind, turn.call) == (TurnKind.INVALID_CALL, ErrorKind.UNPARSEABLE, None)
    assert message in turn.error


def test_call_tool_empty_query_is_its_own_error_kind() -> None:
    assert parse('<call_tool name="search">  \n </call_tool>') == ParsedTurn(
        TurnKind.INVALID_CALL, error="empty query for tool 'search'", error_kind=ErrorKind.EMPTY_QUERY
    )


def test_call_tool_answer_and_earliest_closing_tag() -> None:
    assert parse("<answer> Mebri </answer>") == ParsedTurn(TurnKind.ANSWER, answer="Mebri")
    assert parse('<answer>a</answer><call_tool name="search">q</call_tool>') == ParsedTurn(TurnKind.ANSWER, answer="a")
    assert parse('<call_tool name="search">q</call_tool><answer>a</answer>') == call("search", "q")


def test_call_tool_observation_renders_snippets_and_webpages_with_ids() -> None:
    documents = [
        Document(text="Velmora is a town.", title='"Velmora"', url="local://corpus/3", id="3"),
        Document(text="Full page.", title="Page", url="https://example.org/p", id="p1", kind="webpage"),
    ]
    assert PROTOCOL.observation(documents) == (
        '\n<tool_output>\n<snippet id=3>\nTitle: "Velmora"\nURL: local://corpus/3\nVelmora is a town.\n</snippet>\n'
        "<webpage id=p1>\nTitle: Page\nURL: https://example.org/p\nFull page.\n</webpage>\n</tool_output>\n"
    )


def test_call_tool_observation_ids_without_source_ids_are_stable() -> None:
    first = PROTOCOL.observation([Document(text="same text")])
    assert first == PROTOCOL.observation([Document(text="same text")])
    assert first != PROTOCOL.observation([Document(text="other text")])
    assert PROTOCOL.observation([]) == "\n<tool_output>\nNo results.\n</tool_output>\n"
    error = PROTOCOL.error_observation("unknown tool 'x'")
    assert error == "\n<tool_output>\nError: unknown tool 'x'\n</tool_output>\n"


def test_call_tool_prompt_lists_the_tools_and_the_format() -> None:
    system = PROTOCOL.system_prompt()
    assert "- search: search the collection\n- browse: read a page" in system
    assert '<call_tool name="TOOL_NAME">your query</call_tool>' in system
    assert "<answer>" in system and "<tool_output>" in system
    assert PROTOCOL.instruction("Who built the Geler?") == "Who built the Geler?"
    assert PROTOCOL.stop_strings == ("</call_tool>", "</answer>")


def test_call_tool_prompt_file_is_configurable(tmp_path) -> None:
    path = tmp_path / "prompt.yaml"
    path.write_text('system: "Tools:\\n{tools}"\nuser: "Q: {question}"\ntool_line: "* {name}"\n')
    protocol = CallToolProtocol(TOOLS, prompt_file=path)
    assert (protocol.system_prompt(), protocol.instruction("x")) == ("Tools:\n* search\n* browse", "Q: x")
    path.write_text("system: hi\n")
    with pytest.raises(ValueError, match="missing string key\\(s\\) user, tool_line"):
        PromptTemplate.load(path)


def test_call_tool_json_object_body_is_the_typed_arguments() -> None:
    body = '{"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo", "n": 3, "deep": true}'
    turn = parse(f'<call_tool name="convert_time">\n  {body}  \n</call_tool>')
    arguments = {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo", "n": 3, "deep": True}
    assert turn == ParsedTurn(TurnKind.TOOL_CALL, call=ToolCall("convert_time", body, {}, arguments))
    assert parse('<call_tool name="list_files">{}</call_tool>').call.arguments == {}  # a tool without parameters


def test_call_tool_json_body_gets_the_tag_attributes_it_lacks_as_strings() -> None:
    text = '<call_tool name="convert_time" target_timezone="Asia/Kolkata" time="09:00">{"time": "12:00"}</call_tool>'
    call_made = parse(text).call
    assert call_made.attrs == {"target_timezone": "Asia/Kolkata", "time": "09:00"}  # attributes stay as written
    assert call_made.arguments == {"target_timezone": "Asia/Kolkata", "time": "12:00"}  # the JSON wins
    assert call_made.query == '{"time": "12:00"}'


@pytest.mark.parametrize(
    "body",
    [
        "{capital} of Velmora",  # braces in a search query
        '{"time": "12:00"} and more',  # JSON followed by text
        '{"time": "12:00"',  # unterminated
        '["UTC", "12:00"]',  # JSON, but not an object
        '"12:00"',
        '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}",  # too deep for the decoder
    ],
)
def test_call_tool_body_that_is_not_a_json_object_stays_a_plain_query(body: str) -> None:
    turn = parse(f'<call_tool name="search" topk="2">{body}</call_tool>')
    assert turn == ParsedTurn(TurnKind.TOOL_CALL, call=ToolCall("search", body, {"topk": "2"}, None))
