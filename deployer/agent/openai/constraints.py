"""What a chat request's output must look like, as one llguidance grammar for the engines'
constrained decoding: `response_format` (json_object, json_schema) and `tool_choice`.

- `required` or a named function: the output is tool calls (one for a named function, one or
  more for `required` unless parallel_tool_calls is false) in the Hermes format
  (`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, see chat.tool_call_frame), with
  the arguments constrained by the function's parameter schema: no model can answer in prose.
- `auto`: free text (or the response_format JSON), in which a `<tool_call>` the model starts is
  held to the same frame and schemas from there on (a lazy trigger: the text is never masked).
- `none` or no tools: only response_format constrains.

JSON in every case is written compact, as `json.dumps` does (`{"a": 1, "b": [2, 3]}`: one space
after each colon and comma, none elsewhere), and an integer without bounds is held to
±(2^53 - 1), the integers every JSON parser reads exactly. Both for one reason: a model that would
rather write something the schema forbids has nothing left but free whitespace or more digits,
and fills max_tokens with them (a small model under a strict schema wrote `{"city"` and then
newlines until the budget ran out). Tool arguments hold only the declared parameters
(additionalProperties false where an object with properties says nothing else): they become a
function's arguments, where an undeclared one is an error; a `strict` json_schema is closed the
same way.

A request holds at most 128 tools (schemas.MAX_TOOLS) and 256 KiB of their parameter schemas
(MAX_TOOL_SCHEMA_BYTES); more is a 400 naming `tools`. The routes build the grammar in a worker
thread: it takes up to some tenths of a second, which the event loop never waits for.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from llguidance import LLMatcher

from deployer.agent.chat import TOOL_CALL_OPEN, tool_call_frame
from deployer.agent.openai.schemas import (
    ApiError,
    ChatCompletionRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    ToolIn,
)

__all__ = ["MAX_TOOL_SCHEMA_BYTES", "grammar_for"]

# Compact JSON as json.dumps writes it (and OpenAI's strict output reads): no free whitespace, which
# a small model would otherwise spend its budget on ('{"city"\n\n\n\n:\n\n' until max_tokens).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SAFE_INTEGER = 2**53 - 1
MAX_TOOL_SCHEMA_BYTES = 256 << 10
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_VALUES = ("enum", "const", "default", "examples")  # JSON values in a schema, not schemas
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def grammar_for(request: ChatCompletionRequest) -> str | None:
    """The grammar the answer must match (None: unconstrained). Raises ApiError 400 naming the
    parameter for a schema that is not one or that llguidance cannot enforce."""
    answer = _answer_schema(request)
    mode = request.tool_mode()
    if mode == "none":
        return None if answer is None else _lark(f"start: {_json(answer)}")
    tools = [
        (i, t)
        for i, t in enumerate(request.tools or ())
        if mode in ("auto", "required") or t.function.name == mode
    ]
    _check_size(tools)
    body = _call_body(tools)
    # A named function is called once (as OpenAI does); `required` may call several in parallel.
    several = request.parallel_tool_calls and mode in ("auto", "required")
    some = 'call ("\\n" call)*' if several else "call"
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
        # Strict, as OpenAI's: only the declared properties (OpenAI refuses a schema without
        # additionalProperties false there; we close the objects instead).
        return _rewrite(schema, _closed) if fmt.json_schema.strict else schema
    return None


def _call_body(tools: list[tuple[int, ToolIn]]) -> str:
    """The Lark rule `call_body`: what follows TOOL_CALL_OPEN in a call of any one of `tools` (each
    with its index in the request, which an error names)."""
    bodies = []
    for index, tool in tools:
        schema = tool.function.schema_()
        _check(schema, f"tools.{index}.function.parameters")
        schema = _rewrite(schema, _closed)
        before, after = tool_call_frame(tool.function.name)
        bodies.append(
            f"{json.dumps(before.removeprefix(TOOL_CALL_OPEN))} {_json(schema)} {json.dumps(after)}"
        )
    return f"call_body: {' | '.join(bodies)}\n"


def _check_size(tools: list[tuple[int, ToolIn]]) -> None:
    """ApiError 400 naming `tools` when their parameter schemas are more than this agent compiles:
    compiling grows with them (0.6 s at this limit, in a worker thread), and llguidance refuses a
    grammar not much larger anyway."""
    size = sum(len(json.dumps(tool.function.schema_())) for _, tool in tools)
    if size > MAX_TOOL_SCHEMA_BYTES:
        raise ApiError(
            400,
            f"the tools' parameter schemas come to {size} bytes of JSON, above the "
            f"{MAX_TOOL_SCHEMA_BYTES} this agent compiles into a grammar; send fewer or smaller tools",
            param="tools",
            code="invalid_value",
        )


def _json(schema: dict[str, Any]) -> str:
    """A Lark `%json` item for `schema`, with our whitespace options and integer bounds."""
    return "%json " + json.dumps({**_rewrite(schema, _bounded), "x-guidance": JSON_OPTIONS})


def _rewrite(node: Any, fix: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """`node` with `fix` applied to every schema in it, innermost first (JSON values left alone)."""
    if isinstance(node, list):
        return [_rewrite(item, fix) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _MAPS and isinstance(value, dict):  # name -> schema: the names are no keywords
            out[key] = {name: _rewrite(schema, fix) for name, schema in value.items()}
        else:
            out[key] = value if key in _VALUES else _rewrite(value, fix)
    return fix(out)


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """additionalProperties false on an object schema with properties that says nothing of it."""
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def _bounded(schema: dict[str, Any]) -> dict[str, Any]:
    """±SAFE_INTEGER bounds on an integer schema that has no bound of its own."""
    kind = schema.get("type")
    integer = kind == "integer" or (isinstance(kind, list) and "integer" in kind)
    if integer and not any(b in schema for b in _BOUNDS):
        return {**schema, "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    return schema


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
