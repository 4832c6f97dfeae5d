"""Tool-call grammars (what each tool_choice lets a model write) and the parser that turns the
written calls back into OpenAI tool_calls, however the text is split into stream deltas."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher, LLTokenizer

from deployer.agent.chat import TextCodec, tool_call_text
from deployer.agent.openai.constraints import MAX_TOOL_SCHEMA_BYTES, grammar_for
from deployer.agent.openai.schemas import ApiError, ChatCompletionRequest, parse_request
from deployer.agent.openai.tool_parser import ToolCallParser
from deployer.agent.types import ToolCall

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
PARIS = tool_call_text(ToolCall("x", "get_weather", '{"city": "Paris"}'))
NOW = tool_call_text(ToolCall("y", "get_time", "{}"))


@pytest.fixture(scope="module")
def accepts(tiny_model_dir):
    """accepts(grammar, text): whether a model may write exactly `text` (and then stop)."""
    codec = TextCodec.from_dir(tiny_model_dir)
    tokenizer = LLTokenizer(codec.to_json(), eos_token=[codec.token_id("<|im_end|>")])

    def check(grammar: str, text: str) -> bool:
        matcher = LLMatcher(tokenizer, grammar)
        ids = codec.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    return check


def _grammar(**extra):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, TIME], **extra}
    return grammar_for(parse_request(ChatCompletionRequest, body))


def test_a_named_function_is_one_call_of_it(accepts):
    grammar = _grammar(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert accepts(grammar, PARIS)
    assert not accepts(grammar, "It is sunny.")
    assert not accepts(grammar, NOW)
    assert not accepts(grammar, PARIS + "\n" + PARIS)
    assert not accepts(grammar, PARIS.replace('"Paris"}', '"Paris", "extra": 1}'))  # undeclared argument


def test_required_is_one_or_more_calls_of_any_tool(accepts):
    grammar = _grammar(tool_choice="required")
    assert accepts(grammar, PARIS) and accepts(grammar, PARIS + "\n" + NOW)
    assert not accepts(grammar, "Sure: " + PARIS)
    assert not accepts(_grammar(tool_choice="required", parallel_tool_calls=False), PARIS + "\n" + NOW)


def test_auto_lets_text_through_and_holds_calls_to_their_schema(accepts):
    grammar = _grammar(tool_choice="auto")
    assert accepts(grammar, "It is sunny in Paris.")
    assert accepts(grammar, "Let me check.\n" + PARIS)
    assert not accepts(grammar, "Let me check.\n" + PARIS.replace('{"city": "Paris"}', '{"town": 1}'))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    with_format = _grammar(tool_choice="auto", response_format=fmt)
    assert accepts(with_format, '{"ok": true}') and accepts(with_format, PARIS)
    assert not accepts(with_format, "It is sunny.")


def test_none_and_no_tools_leave_text_free():
    assert _grammar(tool_choice="none") is None
    assert (
        grammar_for(
            parse_request(
                ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            )
        )
        is None
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}]},
            "tools.0.function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": 3}}}]},
            "tools.0.function.parameters",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_bad_schemas_are_400s_naming_the_parameter(extra, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto", **extra}
    with pytest.raises(ApiError) as info:
        grammar_for(parse_request(ChatCompletionRequest, body))
    assert (info.value.status, info.value.param) == (400, param)


def test_json_is_compact_so_no_budget_goes_on_whitespace(accepts):
    # A small model under a strict schema wrote '{"city"\n\n\n\n:\n\n ...' until max_tokens: JSON
    # from schemas and tools has no free whitespace, only json.dumps's one space after ":" and ",".
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "tags": {"type": "array"}},
        "required": ["city", "days"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": schema, "strict": True}}
    grammar = _grammar(tool_choice="none", response_format=fmt)
    assert accepts(grammar, '{"city": "Paris", "days": 2}')
    assert accepts(grammar, '{"city": "Paris", "days": 2, "tags": ["a", 1]}')
    for spaced in (
        '{"city"\n: "Paris", "days": 2}',
        '{ "city": "Paris", "days": 2}',
        '{"city":  "Paris", "days": 2}',
    ):
        assert not accepts(grammar, spaced), spaced
    named = _grammar(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert not accepts(named, PARIS.replace('{"city": "Paris"}', '{"city":\n"Paris"}'))


def test_too_many_or_too_large_tools_are_400s_naming_tools():
    # 5,000 tools (~900 KB) took seconds of a quadratic lookup on the event loop; now they are
    # refused by count (OpenAI's 128) before any work, and 100 large schemas by their size.
    def tools(count: int, properties: int) -> list[dict]:
        schema = {"type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(properties)}}
        return [
            {"type": "function", "function": {"name": f"f{i}", "parameters": schema}} for i in range(count)
        ]

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}
    with pytest.raises(ApiError) as info:
        parse_request(ChatCompletionRequest, {**body, "tools": tools(5000, 2)})
    assert (info.value.status, info.value.param) == (400, "tools")
    with pytest.raises(ApiError) as info:
        grammar_for(parse_request(ChatCompletionRequest, {**body, "tools": tools(100, 200)}))
    assert (info.value.status, info.value.param) == (400, "tools")
    assert f"above the {MAX_TOOL_SCHEMA_BYTES}" in info.value.message
    assert grammar_for(parse_request(ChatCompletionRequest, {**body, "tools": tools(128, 2)}))  # within both


def _parse(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    parser = ToolCallParser({"get_weather", "get_time"})
    content, calls, last = "", [], 0
    for cut in [*sorted(cuts), len(text)]:
        piece, done = parser.feed(text[last:cut])
        content, calls, last = content + piece, calls + done, cut
    piece, done = parser.finish()
    return content + piece, [(c.name, c.arguments) for c in calls + done]


TEXTS = [
    ("plain answer < not a tag", ("plain answer < not a tag", [])),
    ("\n" + PARIS + "\n", ("", [("get_weather", '{"city": "Paris"}')])),
    (
        "Checking.\n" + PARIS + "\n" + NOW,
        ("Checking.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ),
    ('<tool_call>{"name": "unknown"}</tool_call>', ('<tool_call>{"name": "unknown"}</tool_call>', [])),
    (PARIS[: -len("</tool_call>")], ("", [("get_weather", '{"city": "Paris"}')])),  # cut by max_tokens
    ("<tool_call>\n{broken", ("<tool_call>\n{broken", [])),
]


@pytest.mark.parametrize(("text", "expected"), TEXTS)
def test_calls_are_parsed(text, expected):
    assert _parse(text, []) == expected


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 200), max_size=8))
def test_any_split_into_deltas_parses_the_same(case, cuts):
    text, expected = case
    assert _parse(text, [c for c in cuts if c <= len(text)]) == expected
    assert all(json.loads(args) is not None for _, args in expected[1])
