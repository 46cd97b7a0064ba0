from rlsearch.tools import Document, ErrorKind, ParsedTurn, SearchR1Protocol, ToolCall, TurnKind

PROTOCOL = SearchR1Protocol()


def parse(text: str) -> ParsedTurn:
    return PROTOCOL.parse_turn(text)


def search_call(query: str) -> ParsedTurn:
    return ParsedTurn(TurnKind.TOOL_CALL, call=ToolCall("search", query))


def test_normal_search_call() -> None:
    text = "<think>I need the capital.</think>\n<search> capital of France </search>"
    assert parse(text) == search_call("capital of France")


def test_junk_after_search_close_is_ignored() -> None:
    assert parse("<search>who wrote Hamlet</search>\n\n<inf") == search_call("who wrote Hamlet")


def test_search_without_closing_tag_is_not_a_call() -> None:
    assert parse("<think>ok</think><search>who wrote Ham") == ParsedTurn(TurnKind.NONE)


def test_plain_text_is_none() -> None:
    assert parse("I am not sure what to do.") == ParsedTurn(TurnKind.NONE)


def test_search_close_without_opening_tag_is_invalid() -> None:
    turn = parse("<think>hmm</think> capital of France</search>")
    assert turn.kind is TurnKind.INVALID_CALL
    assert turn.call is None
    assert turn.error.startswith("missing <search> opening tag")


def test_empty_query_is_invalid() -> None:
    assert parse("<search>   </search>") == ParsedTurn(
        TurnKind.INVALID_CALL, error="empty search query", error_kind=ErrorKind.EMPTY_QUERY
    )


def test_only_first_of_two_calls_is_executed() -> None:
    assert parse("<search>first query</search><search>second query</search>") == search_call("first query")


def test_answer() -> None:
    text = "<think>It is Paris.</think>\n<answer> Paris </answer>"
    assert parse(text) == ParsedTurn(TurnKind.ANSWER, answer="Paris")


def test_junk_after_answer_close_is_ignored() -> None:
    assert parse("<answer>1889</answer><|im_end|>\nmore") == ParsedTurn(TurnKind.ANSWER, answer="1889")


def test_answer_takes_the_block_closed_by_the_first_close_tag() -> None:
    text = "<answer>draft<answer> final </answer> <answer>later</answer>"
    assert parse(text) == ParsedTurn(TurnKind.ANSWER, answer="final")


def test_answer_close_without_opening_tag_is_invalid() -> None:
    assert parse("The answer is Paris</answer>") == ParsedTurn(
        TurnKind.INVALID_CALL, error="missing <answer> opening tag", error_kind=ErrorKind.UNPARSEABLE
    )


def test_answer_without_closing_tag_is_none() -> None:
    assert parse("<answer> Paris") == ParsedTurn(TurnKind.NONE)


def test_earliest_closing_tag_decides_the_action() -> None:
    assert parse("<search>q1</search><answer>a</answer>") == search_call("q1")
    assert parse("<answer>a</answer><search>q1</search>") == ParsedTurn(TurnKind.ANSWER, answer="a")


def test_search_tag_mentioned_inside_think_uses_the_last_opening_tag() -> None:
    text = "<think>I will use <search> to look it up.</think>\n<search>Eiffel Tower height</search>"
    assert parse(text) == search_call("Eiffel Tower height")


def test_unicode_query() -> None:
    assert parse("<search>Þórr 北京 café — naïve</search>") == search_call("Þórr 北京 café — naïve")


def test_query_with_angle_brackets() -> None:
    assert parse("<search>is 3 < 5 > 2 <b>bold</b></search>") == search_call("is 3 < 5 > 2 <b>bold</b>")


def test_observation_renders_title_and_body() -> None:
    documents = ['"Paris"\nParis is the capital of France.', '"Lyon"\nLyon is a city.\nSecond line.']
    assert PROTOCOL.observation([Document.from_passage(contents) for contents in documents]) == (
        '\n\n<information>Doc 1(Title: "Paris") Paris is the capital of France.\n'
        'Doc 2(Title: "Lyon") Lyon is a city.\nSecond line.</information>\n\n'
    )


def test_observation_of_no_documents() -> None:
    assert PROTOCOL.observation([]) == "\n\n<information></information>\n\n"


def test_error_observation() -> None:
    assert PROTOCOL.error_observation("empty search query") == (
        "\n\n<information>Error: empty search query</information>\n\n"
    )


def test_instruction_ends_with_the_question() -> None:
    prompt = PROTOCOL.instruction("Who wrote Hamlet?")
    assert prompt.endswith("Question: Who wrote Hamlet?\n")
    for tag in ("<think>", "<search>", "</search>", "<information>", "<answer>", "</answer>"):
        assert tag in prompt


def test_stop_strings_are_the_closing_tags() -> None:
    assert PROTOCOL.stop_strings == ("</search>", "</answer>")
    assert PROTOCOL.name == "search_r1"
