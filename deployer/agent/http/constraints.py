"""What a chat request's output must look like, as one llguidance grammar for the engines'
constrained decoding: `response_format` (json_object, json_schema) and `tool_choice`.

- `required` or a named function: the output is one or more tool calls in the Hermes format
  (`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, see chat.tool_call_frame), with
  the arguments constrained by the function's parameter schema: no model can answer in prose.
- `auto`: free text (or the response_format JSON), in which a `<tool_call>` the model starts is
  held to the same frame and schemas from there on (a lazy trigger: the text is never masked).
- `none` or no tools: only response_format constrains.

JSON in every case allows at most a few spaces and newlines between tokens (pretty-printed JSON
stays possible): unbounded whitespace lets a small model fill max_tokens with it.
"""

from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher

from deployer.agent.chat import TOOL_CALL_OPEN, tool_call_frame
from deployer.agent.http.openai_schemas import (
    ApiError,
    ChatCompletionRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    ToolIn,
)

__all__ = ["grammar_for"]

JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A]{0,16}"}


def grammar_for(request: ChatCompletionRequest) -> str | None:
    """The grammar the answer must match (None: unconstrained). Raises ApiError 400 naming the
    parameter for a schema that is not one or that llguidance cannot enforce."""
    answer = _answer_schema(request)
    mode = request.tool_mode()
    if mode == "none":
        return None if answer is None else _lark(f"start: {_json(answer)}")
    tools = [t for t in request.tools or () if mode in ("auto", "required") or t.function.name == mode]
    body = _call_body(tools, request)
    some = 'call ("\\n" call)*' if request.parallel_tool_calls else "call"
    opening = json.dumps(TOOL_CALL_OPEN)
    if mode == "auto" and answer is None:
        # Free text; once the model writes the opening tag, the rest of the call is held to the frame.
        lazy = f"opened[lazy]: TEXT {opening}\ncall: opened call_body\n"
        return _lark(f"start: call* TEXT\nTEXT: /(.|\\n)*/\n{lazy}{body}")
    start = f"{_json(answer)} | {some}" if mode == "auto" and answer is not None else some
    return _lark(f"start: {start}\ncall: {opening} call_body\n{body}")


def _answer_schema(request: ChatCompletionRequest) -> dict[str, Any] | None:
    fmt = request.response_format
    if isinstance(fmt, JsonObjectFormat):
        return {"type": "object"}
    if isinstance(fmt, JsonSchemaFormat):
        schema = fmt.json_schema.schema_
        if schema is None:
            raise ApiError(
                400,
                "response_format.json_schema.schema is missing",
                param="response_format.json_schema.schema",
                code="missing_parameter",
            )
        _check(schema, "response_format.json_schema.schema")
        return schema
    return None


def _call_body(tools: list[ToolIn], request: ChatCompletionRequest) -> str:
    """The Lark rule `call_body`: what follows TOOL_CALL_OPEN in a call of any one of `tools`."""
    all_tools = request.tools or []
    bodies = []
    for tool in tools:
        schema = tool.function.schema_()
        _check(schema, f"tools.{all_tools.index(tool)}.function.parameters")
        before, after = tool_call_frame(tool.function.name)
        bodies.append(
            f"{json.dumps(before.removeprefix(TOOL_CALL_OPEN))} {_json(schema)} {json.dumps(after)}"
        )
    return f"call_body: {' | '.join(bodies)}\n"


def _json(schema: dict[str, Any]) -> str:
    """A Lark `%json` item for `schema`, with our whitespace options."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def _check(schema: object, param: str) -> None:
    """ApiError 400 unless `schema` is a JSON schema llguidance can enforce."""
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param} must be a JSON schema object", param=param, code="invalid_schema")
    try:
        error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema))
    except ValueError as exc:
        error = str(exc)
    if error:
        raise ApiError(
            400, f"{param} is not a usable JSON schema: {error}", param=param, code="invalid_schema"
        )


def _lark(source: str) -> str:
    grammar = LLMatcher.grammar_from_lark("%llguidance {}\n" + source)
    error = LLMatcher.validate_grammar(grammar)
    if error:  # our own rules are wrong, or a schema combination llguidance refuses
        raise ApiError(400, f"the output constraints cannot be compiled: {error}", code="invalid_schema")
    return grammar
